use std::fmt;
use std::ops::{Deref, Range};
use std::sync::Arc;

/// A cheaply clonable, immutable byte range that keeps its backing storage (mmap, buffer) alive.
///
/// ```
/// use expert_store::OwnedBytes;
/// let all = OwnedBytes::from_vec((0u8..16).collect());
/// let expert = all.slice(4..8).unwrap(); // shares the buffer, no copy
/// assert_eq!(&*expert, &[4, 5, 6, 7]);
/// assert!(all.slice(10..20).is_none());
/// ```
#[derive(Clone)]
pub struct OwnedBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl OwnedBytes {
    /// Wraps a whole buffer.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>) -> Self {
        let len = (*owner).as_ref().len();
        Self { owner, start: 0, len }
    }

    /// Wraps an in-memory vector.
    pub fn from_vec(v: Vec<u8>) -> Self {
        Self::new(Arc::new(v))
    }

    /// A sub-range of this range; `None` if it does not fit.
    pub fn slice(&self, range: Range<usize>) -> Option<Self> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        Some(Self {
            owner: Arc::clone(&self.owner),
            start: self.start + range.start,
            len: range.end - range.start,
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
}

impl Deref for OwnedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for OwnedBytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for OwnedBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnedBytes({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_nest_and_reject_out_of_range() {
        let b = OwnedBytes::from_vec((0u8..10).collect());
        let s = b.slice(2..8).unwrap();
        assert_eq!(&*s, &[2, 3, 4, 5, 6, 7]);
        assert_eq!(&*s.slice(1..3).unwrap(), &[3, 4]);
        assert!(s.slice(3..7).is_none());
        #[allow(clippy::reversed_empty_ranges)]
        let bad = s.slice(4..2);
        assert!(bad.is_none());
    }
}
