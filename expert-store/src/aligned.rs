//! Page-aligned, zero-initialised heap buffers: the persistent slots expert records are read into.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// Alignment of every slot: Apple's 16 KiB page, a multiple of the 4 KiB O_DIRECT block.
pub const SLOT_ALIGN: usize = 16 * 1024;

/// A fixed-size buffer aligned to [`SLOT_ALIGN`], allocated once and reused.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain bytes owned by this value; shared access is read-only through `&self`,
// mutation needs `&mut self`, so the usual borrow rules make cross-thread use sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send`: `&AlignedBuf` only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to a whole number of pages); `None` if allocation fails.
    pub fn new(len: usize) -> Option<Self> {
        let len = len.max(1).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let layout = Layout::from_size_align(len, SLOT_ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size; a null return is handled below.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(Self { ptr, layout })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// The bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by `self`, and
        // `&mut self` guarantees no other reference exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self`, borrowed immutably here.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated by `alloc_zeroed` with exactly `layout` and is freed only here.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::new(5000).unwrap();
        assert_eq!(b.len(), SLOT_ALIGN);
        assert_eq!(b.as_ref().as_ptr() as usize % SLOT_ALIGN, 0);
        assert!(b.as_ref().iter().all(|&x| x == 0));
        b.as_mut_slice()[4999] = 7;
        assert_eq!(b.as_ref()[4999], 7);
    }
}
