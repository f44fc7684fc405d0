//! What MLX says about its device: Metal's recommended working-set size (the GPU's share of unified memory),
//! and the one allocator setting the memory plan makes.

/// Caps the freed buffers MLX keeps for reuse at `bytes` (MLX's default is its whole memory limit).
pub fn limit_buffer_cache(bytes: u64) {
    let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    if let Err(e) = mlx_rs::memory::set_cache_limit(bytes) {
        tracing::warn!("mlx: could not limit its buffer cache: {e}");
    }
}

/// `max_recommended_working_set_size` of MLX's default device (Metal), if it reports one; the CPU build of MLX
/// (Linux) does not.
pub fn recommended_working_set() -> Option<u64> {
    let key = c"max_recommended_working_set_size";
    let mut bytes: usize = 0;
    // SAFETY: every handle is created by mlx-c here, passed only to mlx-c, and freed once below; `bytes` and
    // `key` outlive the calls that read or write them.
    let found = unsafe {
        let mut dev = mlx_sys::mlx_device_new();
        let mut info = mlx_sys::mlx_device_info_new();
        let found = mlx_sys::mlx_get_default_device(&mut dev) == 0
            && mlx_sys::mlx_device_info_get(&mut info, dev) == 0
            && mlx_sys::mlx_device_info_get_size(&mut bytes, info, key.as_ptr()) == 0;
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(dev);
        found
    };
    (found && bytes > 0).then_some(bytes as u64)
}
