//! Other Unix systems: no memory facts, ordinary cached I/O.

use std::ffi::c_void;
use std::fs::File;
use std::io;
use std::path::Path;
use std::ptr::NonNull;

pub(super) fn huge_pages() -> Option<super::HugePages> {
    None
}

pub(super) fn os_release() -> Option<String> {
    None
}

pub(super) fn total_memory() -> Option<u64> {
    None
}

pub(super) fn available_memory() -> Option<u64> {
    None
}

pub(super) fn resident_bytes() -> Option<u64> {
    None
}

pub(super) fn huge_page_bytes(_addr: usize, _len: usize) -> Option<u64> {
    None
}

pub(super) fn gpu_working_set_limit() -> Option<u64> {
    None
}

pub(super) fn open_for_reads(path: &Path, _uncached: bool) -> io::Result<File> {
    File::open(path)
}

pub(super) fn drop_cached_pages(_file: &File) -> io::Result<()> {
    Ok(())
}

pub(super) fn create_uncached(path: &Path) -> io::Result<(File, bool)> {
    Ok((File::create(path)?, false))
}

pub(super) fn set_cached(_file: &File) -> io::Result<()> {
    Ok(())
}

pub(super) fn advise_huge_pages(_ptr: NonNull<c_void>, _len: usize) {}

pub(super) fn populate(_ptr: NonNull<c_void>, _len: usize) -> bool {
    false
}

pub(super) fn cgroup_memory() -> Option<super::CgroupMemory> {
    None
}
