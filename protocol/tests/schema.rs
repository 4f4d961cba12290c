//! The committed JSON Schema must match what the types generate.
//! Regenerate with `UPDATE_SCHEMA=1 cargo test -p tether-protocol --test schema`.

use std::path::PathBuf;

#[test]
fn schema_file_is_up_to_date() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schema/protocol.schema.json");
    let generated = serde_json::to_string_pretty(&protocol::json_schema()).unwrap() + "\n";
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}; run with UPDATE_SCHEMA=1", path.display()));
    assert!(
        committed == generated,
        "{} is out of date with the protocol types; regenerate it with \
         `UPDATE_SCHEMA=1 cargo test -p tether-protocol --test schema` and review the diff",
        path.display()
    );
}
