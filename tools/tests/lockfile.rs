//! The committed `Cargo.lock` is the one a Mac build from crates.io needs.
//!
//! `scripts/setup-mlx.sh` patches mlx-sys with the Linux stand-in in `mlx-sys-linux/` (a `[patch]` in
//! `.cargo/config.toml`); with it in place cargo rewrites the lockfile without mlx-sys's registry source and
//! checksum, and a commit of that file breaks `cargo build --features mlx` on macOS. CI runs this before
//! the mlx step.

/// The `[[package]]` block of `name` in a lockfile's text.
fn package<'a>(lock: &'a str, name: &str) -> Option<&'a str> {
    lock.split("[[package]]")
        .find(|block| block.lines().any(|l| l.trim() == format!("name = \"{name}\"")))
}

#[test]
fn the_lockfile_takes_mlx_sys_from_crates_io() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.lock");
    let lock = std::fs::read_to_string(&path).expect("Cargo.lock at the workspace root");
    let block = package(&lock, "mlx-sys").expect("mlx-sys in Cargo.lock");
    let hint = "Cargo.lock was rewritten under scripts/setup-mlx.sh's [patch]: remove .cargo/config.toml and \
                run `git checkout -- Cargo.lock`";
    assert!(
        block.contains("source = \"registry+https://github.com/rust-lang/crates.io-index\""),
        "{hint}\n{block}"
    );
    assert!(block.contains("checksum = "), "{hint}\n{block}");
}

#[test]
fn a_patched_lockfile_is_told_apart() {
    // What the lockfile holds under the patch: the stand-in by path, no source, no checksum.
    let patched = "[[package]]\nname = \"mlx-rs\"\nversion = \"0.25.3\"\n\n[[package]]\nname = \"mlx-sys\"\n\
                   version = \"0.7.0\"\ndependencies = [\n \"cc\",\n]\n";
    let block = package(patched, "mlx-sys").unwrap();
    assert!(!block.contains("source = "));
    assert!(package(patched, "mlx-sys-linux").is_none());
}
