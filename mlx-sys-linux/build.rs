//! Builds mlx-c against a prebuilt MLX and generates its Rust bindings. Downloads nothing:
//! - mlx-c sources: `$MLX_C_SRC`, else the copy inside the crates.io package `mlx-sys-0.7.0` in the cargo
//!   registry (`scripts/setup-mlx.sh` fetches it);
//! - MLX: `$MLX_PREFIX`, a directory with `lib/libmlx.so` and `include/mlx/mlx.h` (the `mlx` directory of the
//!   `mlx-cpu` wheel; the setup script unpacks one into `.mlx/` and points `MLX_PREFIX` at it).
//!
//! Publishes `DEP_MLX_LIB_DIR` so crates that link binaries can put the library in their rpath.
//!
//! **Check-only mode.** When the target is not the host (CI type-checks the mlx backend for
//! `aarch64-apple-darwin` from Linux: `cargo check/clippy --target ...`), there is no linker or MLX for that
//! target here, so it only generates the bindings, with the host's C headers (mlx-c's API has the same
//! types and layouts on every 64-bit target), and builds and links nothing. Such a build type-checks; it
//! cannot link.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const UPSTREAM: &str = "mlx-sys-0.7.0";

fn fail(msg: String) -> ! {
    eprintln!("error: {msg}");
    panic!("{msg}");
}

/// The mlx-c source root (the directory holding `mlx/c/mlx.h`).
fn mlx_c_sources() -> PathBuf {
    if let Some(dir) = env::var_os("MLX_C_SRC") {
        return PathBuf::from(dir);
    }
    let home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))
        .unwrap_or_else(|| fail("neither CARGO_HOME nor HOME is set".into()));
    let registry = home.join("registry").join("src");
    let mut found: Vec<PathBuf> = fs::read_dir(&registry)
        .into_iter()
        .flatten()
        .flatten()
        .map(|index| index.path().join(UPSTREAM).join("src").join("mlx-c"))
        .filter(|p| p.join("mlx/c/mlx.h").is_file())
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| {
        fail(format!(
            "mlx-c sources not found under {}/*/{UPSTREAM}/src/mlx-c: run scripts/setup-mlx.sh (or set MLX_C_SRC)",
            registry.display()
        ))
    })
}

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| fail(format!("reading {}: {e}", dir.display())))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    v.sort();
    v
}

/// Compiles mlx-c against the prebuilt MLX at `$MLX_PREFIX` and links it.
fn build_and_link(mlx_c: &Path, c_dir: &Path) {
    let prefix = env::var_os("MLX_PREFIX").map(PathBuf::from).unwrap_or_else(|| {
        fail(
            "MLX_PREFIX is not set: run scripts/setup-mlx.sh, or point it at the `mlx` directory of the mlx-cpu wheel"
                .into(),
        )
    });
    let (include, lib) = (prefix.join("include"), prefix.join("lib"));
    if !lib.join("libmlx.so").is_file() || !include.join("mlx/mlx.h").is_file() {
        fail(format!(
            "{} has no lib/libmlx.so and include/mlx/mlx.h",
            prefix.display()
        ));
    }
    // mlx-c's C++ wrappers (object.cpp is not part of upstream's library either) and the half accessors.
    let mut sources = files(c_dir, "cpp");
    sources.retain(|p| p.file_name().is_some_and(|n| n != "object.cpp"));
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .include(mlx_c)
        .include(&include)
        .files(&sources)
        .file(manifest.join("src/half.cpp"))
        .flag("-include")
        .flag(manifest.join("src/format.h").to_string_lossy().as_ref())
        // thin wrappers: always optimized, never with debug info
        .opt_level(2)
        .debug(false)
        .warnings(false)
        .compile("mlxc");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:lib_dir={}", lib.display());
}

fn main() {
    for var in ["MLX_C_SRC", "MLX_PREFIX", "CARGO_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for f in ["src/half.cpp", "src/format.h"] {
        println!("cargo:rerun-if-changed={f}");
    }
    let (target, host) = (
        env::var("TARGET").expect("set by cargo"),
        env::var("HOST").expect("set by cargo"),
    );
    let check_only = target != host;
    let mlx_c = mlx_c_sources();
    let c_dir = mlx_c.join("mlx").join("c");
    // mlx-c declares its half-precision accessors only where the C compiler has `__fp16` (aarch64 targets);
    // elsewhere src/lib.rs supplies them (cfg `half_shim`).
    let bindings_arch = if check_only { &host } else { &target };
    println!("cargo:rustc-check-cfg=cfg(half_shim)");
    if !bindings_arch.starts_with("aarch64") {
        println!("cargo:rustc-cfg=half_shim");
    }
    if !check_only {
        build_and_link(&mlx_c, &c_dir);
    }

    let mut bindings = bindgen::Builder::default()
        .clang_arg(format!("-I{}", mlx_c.display()))
        .allowlist_function("_?mlx_.*")
        .allowlist_type("_?mlx_.*")
        .allowlist_var("_?mlx_.*|MLX_.*")
        .layout_tests(false);
    if check_only {
        // bindgen would ask clang for the target's headers, which this machine does not have.
        bindings = bindings.clang_arg(format!("--target={host}"));
    }
    for h in files(&c_dir, "h") {
        bindings = bindings.header(h.to_string_lossy());
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("set by cargo")).join("bindings.rs");
    bindings
        .generate()
        .unwrap_or_else(|e| {
            fail(format!(
                "bindgen on the mlx-c headers failed (is libclang-dev installed?): {e}"
            ))
        })
        .write_to_file(&out)
        .unwrap_or_else(|e| fail(format!("writing {}: {e}", out.display())));
}
