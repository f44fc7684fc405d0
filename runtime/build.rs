//! With the `mlx` feature on Linux, MLX is a shared library from the mlx-cpu wheel: put its directory in the
//! rpath of this crate's tests and benches (a dependency's link arguments do not reach them).
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
