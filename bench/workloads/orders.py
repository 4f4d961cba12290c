"""Orders: prices, discounts and totals for a small shop."""
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    unit_price: float
    quantity: int = 1

    def subtotal(self) -> float:
        return self.unit_price * self.quantity


@dataclass
class Order:
    customer: str
    items: list = field(default_factory=list)
    discount_rate: float = 0.0

    def add_item(self, name: str, unit_price: float, quantity: int = 1) -> None:
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.items.append(Item(name, unit_price, quantity))

    def remove_item(self, name: str) -> None:
        self.items = [item for item in self.items if item.name != name]

    def total_price(self) -> float:
        gross = sum(item.subtotal() for item in self.items)
        return round(gross * (1.0 - self.discount_rate), 2)

    def item_count(self) -> int:
        return sum(item.quantity for item in self.items)


def apply_coupon(order: Order, code: str) -> None:
    coupons = {"WELCOME10": 0.10, "SPRING20": 0.20, "VIP30": 0.30}
    if code not in coupons:
        raise KeyError(f"unknown coupon {code}")
    order.discount_rate = max(order.discount_rate, coupons[code])


def format_receipt(order: Order) -> str:
    lines = [f"Receipt for {order.customer}"]
    for item in order.items:
        lines.append(f"  {item.name:<20} {item.quantity:>3} x {item.unit_price:>8.2f}")
    lines.append(f"  {'Total':<20} {order.total_price():>16.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    order = Order("Ada")
    order.add_item("notebook", 3.50, 4)
    order.add_item("pen", 1.20, 10)
    apply_coupon(order, "WELCOME10")
    print(format_receipt(order))
