//! MLX arrays over bytes sluice already holds (expert-store slots, mapped checkpoints), without a copy where
//! MLX's allocator can wrap host memory (Metal on Apple unified memory, page-aligned buffers); MLX's CPU
//! allocator copies instead and releases the bytes at once. Either way the bytes (and the slot under them)
//! stay pinned for exactly as long as MLX may read them.

use std::ffi::c_void;

use expert_store::OwnedBytes;
use mlx_rs::{Array, Dtype};

/// `[rows, words]` u32 packed codes over `bytes`, which must be exactly that long and 4-byte aligned; `None`
/// if they are not (the caller copies).
pub(super) fn u32_array(bytes: &OwnedBytes, rows: usize, words: usize) -> Option<Array> {
    if bytes.len() != rows * words * 4 || !(bytes.as_ptr() as usize).is_multiple_of(4) {
        return None;
    }
    let shape = [i32::try_from(rows).ok()?, i32::try_from(words).ok()?];
    let payload = Box::into_raw(Box::new(bytes.clone())) as *mut c_void;
    // SAFETY: `data` points at `rows·words·4` readable bytes (checked above), 4-byte aligned for u32, which do
    // not change while `payload` (a clone of `bytes`, pinning its buffer) lives; MLX calls `release` once,
    // when it no longer reads them (at once when it copies), and `release` is the only owner of `payload`.
    let raw = unsafe {
        mlx_sys::mlx_array_new_data_managed_payload(
            bytes.as_ptr() as *mut c_void,
            shape.as_ptr(),
            2,
            Dtype::Uint32.into(),
            payload,
            Some(release),
        )
    };
    if raw.ctx.is_null() {
        return None;
    }
    // SAFETY: `raw` is a new, valid array handle that nothing else owns; `Array` takes it over.
    Some(unsafe { Array::from_ptr(raw) })
}

/// Drops the pinned bytes handed to MLX.
unsafe extern "C" fn release(payload: *mut c_void) {
    // SAFETY: `payload` came from `Box::into_raw` in `u32_array` and MLX releases it exactly once.
    drop(unsafe { Box::from_raw(payload as *mut OwnedBytes) });
}
