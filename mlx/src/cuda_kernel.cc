// See cuda_kernel.h.
#include "tether-mlx/src/cuda_kernel.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "mlx/backend/cuda/cuda.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace tether_mlx {
namespace {

std::vector<std::string> split_names(rust::Str joined) {
  std::vector<std::string> names;
  std::string all(joined.data(), joined.size());
  std::stringstream in(all);
  std::string name;
  while (std::getline(in, name, ',')) {
    if (!name.empty()) names.push_back(name);
  }
  return names;
}

std::tuple<int, int, int> three(rust::Slice<const int32_t> v, const char* what) {
  if (v.size() != 3) throw std::invalid_argument(std::string("cuda kernel: ") + what + " needs 3 dimensions");
  return {v[0], v[1], v[2]};
}

}  // namespace

std::unique_ptr<CudaKernel> cuda_kernel_new(rust::Str name, rust::Str inputs, rust::Str outputs, rust::Str source, rust::Str header) {
  // Rows are read as dense buffers: MLX copies any input that is not.
  auto launch = mx::fast::cuda_kernel(
      std::string(name), split_names(inputs), split_names(outputs), std::string(source), std::string(header), /*ensure_row_contiguous=*/true);
  return std::make_unique<CudaKernel>(CudaKernel{std::move(launch)});
}

std::unique_ptr<ArrayList> cuda_kernel_launch(
    const CudaKernel& kernel,
    const ArrayList& inputs,
    rust::Slice<const int32_t> shapes,
    rust::Slice<const int32_t> ndims,
    rust::Slice<const uint8_t> dtypes,
    rust::Slice<const int32_t> grid,
    rust::Slice<const int32_t> block,
    rust::Slice<const rust::Str> names,
    rust::Slice<const uint8_t> kinds,
    rust::Slice<const int32_t> values) {
  if (ndims.size() != dtypes.size()) throw std::invalid_argument("cuda kernel: one dtype per output");
  std::vector<mx::Shape> out_shapes;
  size_t at = 0;
  for (auto n : ndims) {
    if (n < 0 || at + n > shapes.size()) throw std::invalid_argument("cuda kernel: output shapes do not add up");
    out_shapes.emplace_back(shapes.begin() + at, shapes.begin() + at + n);
    at += n;
  }
  std::vector<mx::Dtype> out_dtypes;
  for (auto d : dtypes) out_dtypes.push_back(dtype_from_code(d));
  if (names.size() != kinds.size() || kinds.size() != values.size()) throw std::invalid_argument("cuda kernel: template arguments do not add up");
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> template_args;
  for (size_t i = 0; i < names.size(); ++i) {
    std::string name(names[i].data(), names[i].size());
    switch (kinds[i]) {
      case 0: template_args.emplace_back(std::move(name), int(values[i])); break;
      case 1: template_args.emplace_back(std::move(name), values[i] != 0); break;
      case 2: template_args.emplace_back(std::move(name), dtype_from_code(uint8_t(values[i]))); break;
      default: throw std::invalid_argument("cuda kernel: unknown template argument kind");
    }
  }
  auto out = kernel.launch(
      inputs.items, out_shapes, out_dtypes, three(grid, "grid"), three(block, "block"), template_args, std::nullopt, /*verbose=*/false, {});
  auto list = std::make_unique<ArrayList>();
  list->items = std::move(out);
  return list;
}

bool cuda_available() { return mx::cu::is_available(); }

bool sole_holder(const Array& a) { return a.is_available() && a.is_donatable() && a.flags().row_contiguous; }

rust::String graph_census(const ArrayList& outputs) {
  std::map<std::string, int> counts;
  std::unordered_set<const void*> seen;
  std::vector<mx::array> stack(outputs.items.begin(), outputs.items.end());
  int total = 0;
  while (!stack.empty()) {
    mx::array a = std::move(stack.back());
    stack.pop_back();
    if (!a.has_primitive() || a.is_available()) continue;
    // Siblings (a primitive's several outputs) share one primitive.
    if (!seen.insert(&a.primitive()).second) continue;
    counts[a.primitive().name()] += 1;
    total += 1;
    for (const auto& in : a.inputs()) stack.push_back(in);
  }
  std::vector<std::pair<int, std::string>> sorted;
  for (auto& [name, n] : counts) sorted.emplace_back(n, name);
  std::sort(sorted.begin(), sorted.end(), [](auto& x, auto& y) { return x.first > y.first || (x.first == y.first && x.second < y.second); });
  std::string text;
  for (auto& [n, name] : sorted) text += std::to_string(n) + " " + name + "\n";
  text += "total " + std::to_string(total) + "\n";
  return rust::String(text);
}

}  // namespace tether_mlx
