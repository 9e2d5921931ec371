//! Rebuilds the crate when a migration is added or changed: `sqlx::migrate!` embeds
//! `migrations/` at compile time, and cargo does not know the macro read that directory, so a
//! new migration would otherwise leave an incremental build running the old set.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
