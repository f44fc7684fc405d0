//! Raw bindings to mlx-c (generated at build time) for the Linux CPU build of MLX, plus the few symbols
//! upstream `mlx-sys` only has on aarch64 or macOS.
#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, missing_docs)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// mlx-c declares its half-precision accessors only where the compiler has `__fp16`/`__bf16` (aarch64), but
/// mlx-rs calls them everywhere; `src/half.cpp` implements them over 16-bit storage, and these are the types
/// bindgen would have produced on aarch64. (build.rs sets `half_shim` when the bindings came from a
/// non-aarch64 compiler: an x86-64 build, or a check-only build for another target.)
#[cfg(half_shim)]
mod half_types {
    /// bindgen's rendering of `__fp16` (mlx-rs reads `.0`).
    #[repr(transparent)]
    #[derive(Debug, Default, Copy, Clone, PartialEq, Eq, Hash)]
    pub struct __BindgenFloat16(pub u16);
    pub type float16_t = __BindgenFloat16;
    /// bindgen's rendering of `__bf16`.
    pub type bfloat16_t = u16;
    extern "C" {
        pub fn mlx_array_item_float16(res: *mut float16_t, arr: super::mlx_array) -> ::std::os::raw::c_int;
        pub fn mlx_array_item_bfloat16(res: *mut bfloat16_t, arr: super::mlx_array) -> ::std::os::raw::c_int;
        pub fn mlx_array_data_float16(arr: super::mlx_array) -> *const float16_t;
        pub fn mlx_array_data_bfloat16(arr: super::mlx_array) -> *const bfloat16_t;
    }
}
#[cfg(half_shim)]
pub use half_types::*;

/// mlx-rs seeds its random generator with macOS's `mach_approximate_time()`; Linux has no such symbol, so
/// this provides one (nanoseconds since the epoch).
#[cfg(not(target_vendor = "apple"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}
