//! The one place that maps files into memory.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::StoreError;

/// Maps a whole file read-only.
pub(crate) fn map_file(path: &Path) -> Result<Mmap, StoreError> {
    let io = |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: the mapping is read-only and private to this process. Weight files are treated as immutable
    // while served; a file truncated underneath us by another process is outside what we can defend against
    // (the same contract as every mmap-based model loader).
    unsafe { Mmap::map(&file) }.map_err(io)
}
