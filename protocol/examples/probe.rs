fn main() {
    for l in std::io::stdin().lines() {
        let l = l.unwrap();
        match protocol::parse_client(&l) {
            Ok(m) => println!("OK {m:?}"),
            Err(e) => println!("ERR {:?} {:?} | {}", e.code, e.request_id, e.message),
        }
    }
}
