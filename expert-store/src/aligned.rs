//! Page-aligned, zero-initialised memory for the persistent slots expert records are read into: one
//! anonymous mapping made once (backed by transparent huge pages where the OS allows, so the kernels'
//! streams are not cut at every 4 KiB page), split into disjoint fixed-size slots.

use std::ptr::NonNull;
use std::sync::Arc;

/// Alignment of every slot: Apple's 16 KiB page, a multiple of the 4 KiB O_DIRECT block.
pub const SLOT_ALIGN: usize = 16 * 1024;

/// Alignment of the first slot: a huge page, so the arena can be backed by 2 MiB pages.
const ARENA_ALIGN: usize = 2 << 20;

/// One mapping holding every slot; slots start at the first [`ARENA_ALIGN`] boundary inside it.
struct Arena {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the arena is plain bytes; it is only accessed through `SlotBuf`s, which cover disjoint ranges and
// follow the borrow rules (see `SlotBuf`).
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the mapping made in `SlotBuf::allocate`, unmapped only here,
        // after every `SlotBuf` (each holds an `Arc<Arena>`) is gone.
        unsafe { crate::platform::unmap(self.ptr, self.len) };
    }
}

/// A fixed-size, [`SLOT_ALIGN`]-aligned slot: a range of an arena that no other slot overlaps.
pub struct SlotBuf {
    arena: Arc<Arena>,
    offset: usize,
    len: usize,
}

impl SlotBuf {
    /// `count` zeroed slots of `len` bytes each (rounded up to [`SLOT_ALIGN`]); `None` if allocation fails.
    pub fn allocate(count: usize, len: usize) -> Option<Vec<SlotBuf>> {
        let len = len.max(1).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let used = len.checked_mul(count.max(1))?;
        let total = used.checked_add(ARENA_ALIGN)?;
        let ptr = crate::platform::map_zeroed(total)?;
        // From the address itself: `align_offset` may answer `usize::MAX`, and slot offsets depend on it.
        let start = (ARENA_ALIGN - ptr.as_ptr() as usize % ARENA_ALIGN) % ARENA_ALIGN;
        let arena = Arc::new(Arena { ptr, len: total });
        Some(
            (0..count)
                .map(|i| SlotBuf {
                    arena: Arc::clone(&arena),
                    offset: start + i * len,
                    len,
                })
                .collect(),
        )
    }

    /// The address and length of the slots' whole mapping (the arena this slot was cut from).
    pub fn arena_span(&self) -> (usize, usize) {
        (self.arena.ptr.as_ptr() as usize, self.arena.len)
    }

    /// The slot length a record of `len` bytes needs.
    pub fn slot_len(len: usize) -> usize {
        len.max(1).div_ceil(SLOT_ALIGN) * SLOT_ALIGN
    }

    /// Splits off the first `at` bytes as their own slot (same arena), leaving the rest in `self`; `None` if
    /// `at` is past the end. Alignment past the first slot is the caller's.
    pub fn split_to(&mut self, at: usize) -> Option<SlotBuf> {
        if at > self.len {
            return None;
        }
        let head = SlotBuf {
            arena: Arc::clone(&self.arena),
            offset: self.offset,
            len: at,
        };
        self.offset += at;
        self.len -= at;
        Some(head)
    }

    /// The bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `offset..offset + len` lies inside the arena (checked at allocation), initialised (zeroed),
        // and no other `SlotBuf` covers it; `&mut self` on this unique, non-`Clone` owner rules out any
        // other reference to these bytes.
        unsafe { std::slice::from_raw_parts_mut(self.arena.ptr.as_ptr().add(self.offset), self.len) }
    }
}

/// Slots to back with memory ahead of their first read, in the order they will be used. The first write to
/// fresh anonymous memory stops to fault and zero its pages (on a virtual machine the host may back each page
/// first, slower than the disk reads), so an I/O thread reading into a fresh slot spends part of the read on
/// that; a background pass started with the engine does it before most reads arrive. It holds the arena, not
/// the slots, so slot ownership (`Arc::get_mut`, eviction's reference counts) is untouched.
pub struct Prefault {
    arena: Arc<Arena>,
    ranges: Vec<(usize, usize)>,
}

impl Prefault {
    /// A pass over `slots` in the order given; `None` if there are none or they come from more than one
    /// allocation.
    pub fn new<'a>(slots: impl IntoIterator<Item = &'a SlotBuf>) -> Option<Self> {
        let mut arena = None;
        let mut ranges = Vec::new();
        for slot in slots {
            let a = arena.get_or_insert_with(|| Arc::clone(&slot.arena));
            if !Arc::ptr_eq(a, &slot.arena) {
                return None;
            }
            ranges.push((slot.offset, slot.len));
        }
        Some(Self { arena: arena?, ranges })
    }

    /// Backs each slot in turn until all are done or `stop()` says so (asked before each slot), calling
    /// `backed()` after each slot backed; returns the bytes backed (0 where the OS cannot back memory
    /// without writing it).
    pub fn run(&self, stop: impl Fn() -> bool, mut backed: impl FnMut()) -> usize {
        let page = crate::platform::page_size() as usize;
        let mut done = 0;
        for &(offset, len) in &self.ranges {
            if stop() {
                break;
            }
            let (start, span) = page_span(offset, len, page, self.arena.len);
            // SAFETY: `start..start + span` covers the slot's whole pages, inside the arena's mapping (which the
            // OS made whole pages long), which `self.arena` keeps mapped; the pointer is in bounds and not null.
            let ptr = unsafe { NonNull::new_unchecked(self.arena.ptr.as_ptr().add(start)) };
            if !crate::platform::populate(ptr, span) {
                break;
            }
            done += len;
            backed();
        }
        done
    }
}

/// The whole pages of `page` bytes that hold `offset..offset + len` of an arena `arena_len` long: the OS backs
/// pages, and refuses a range that starts inside one (slots are 16 KiB-aligned, pages 64 KiB on some aarch64
/// kernels). Backing a neighbour's part of a page is harmless: it changes no byte.
fn page_span(offset: usize, len: usize, page: usize, arena_len: usize) -> (usize, usize) {
    let start = offset - offset % page;
    let end = (offset + len)
        .next_multiple_of(page)
        .min(arena_len.next_multiple_of(page));
    (start, end - start)
}

impl AsRef<[u8]> for SlotBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: as in `as_mut_slice`, borrowed immutably through `&self`.
        unsafe { std::slice::from_raw_parts(self.arena.ptr.as_ptr().add(self.offset), self.len) }
    }
}

/// Memory for resident weights that the kernels stream (a model's attention and shared matrices, repacked
/// at load): pieces cut one after another from large huge-page-backed chunks, like the expert slots, so a
/// matrix's stream is not cut at every 4 KiB page. Measured on medium (AVX-512, 2 threads): attention
/// projections from 4 KiB pages ran ~17% slower than from huge pages.
#[derive(Default)]
pub struct ResidentArena {
    /// The unused tail of the current chunk.
    rest: std::sync::Mutex<Option<SlotBuf>>,
}

impl ResidentArena {
    /// Bytes mapped per chunk; a larger piece gets a chunk of its own. Only the pages pieces use are backed.
    pub const CHUNK: usize = 64 << 20;
    /// Alignment of every piece: a cache line, so the kernels' 64-byte loads never straddle two.
    pub const PIECE_ALIGN: usize = 64;

    /// A piece of `len` bytes, zeroed, handed to `fill` and then frozen; `None` if `fill` says no or memory
    /// cannot be mapped.
    pub fn place(&self, len: usize, fill: impl FnOnce(&mut [u8]) -> bool) -> Option<crate::OwnedBytes> {
        let cut = len.max(1).next_multiple_of(Self::PIECE_ALIGN);
        let mut piece = {
            let mut rest = self.rest.lock().unwrap_or_else(|e| e.into_inner());
            if rest.as_ref().is_none_or(|r| r.len < cut) {
                *rest = Some(SlotBuf::allocate(1, cut.max(Self::CHUNK))?.pop()?);
            }
            rest.as_mut()?.split_to(cut)?
        };
        if !fill(&mut piece.as_mut_slice()[..len]) {
            return None;
        }
        crate::OwnedBytes::new(Arc::new(piece)).slice(0..len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_disjoint_and_writable() {
        let mut slots = SlotBuf::allocate(3, 5000).unwrap();
        assert_eq!(slots[0].as_ref().len(), SLOT_ALIGN);
        for (i, s) in slots.iter_mut().enumerate() {
            assert_eq!(s.as_ref().as_ptr() as usize % SLOT_ALIGN, 0);
            assert!(s.as_ref().iter().all(|&x| x == 0));
            s.as_mut_slice().fill(i as u8 + 1);
        }
        for (i, s) in slots.iter().enumerate() {
            assert!(s.as_ref().iter().all(|&x| x == i as u8 + 1));
        }
    }

    #[test]
    fn resident_pieces_are_disjoint_aligned_and_keep_their_bytes() {
        let arena = ResidentArena::default();
        let lens = [100, 64, 1, ResidentArena::CHUNK, 3000, ResidentArena::CHUNK / 2];
        let pieces: Vec<_> = (lens.iter().enumerate())
            .map(|(i, &len)| {
                let p = arena.place(len, |b| {
                    assert!(b.iter().all(|&x| x == 0), "zeroed");
                    b.fill(i as u8 + 1);
                    true
                });
                p.expect("placed")
            })
            .collect();
        for (i, (p, &len)) in pieces.iter().zip(&lens).enumerate() {
            assert_eq!(p.len(), len);
            assert_eq!(p.as_ptr() as usize % ResidentArena::PIECE_ALIGN, 0, "piece {i}");
            assert!(p.iter().all(|&x| x == i as u8 + 1), "piece {i} kept its bytes");
        }
        assert!(arena.place(10, |_| false).is_none(), "a refused fill gives no piece");
        let mut slot = SlotBuf::allocate(1, 10).unwrap().pop().unwrap();
        assert!(slot.split_to(SLOT_ALIGN + 1).is_none());
        let head = slot.split_to(100).unwrap();
        assert_eq!((head.as_ref().len(), slot.as_ref().len()), (100, SLOT_ALIGN - 100));
    }

    #[test]
    fn prefault_backs_whole_pages_of_any_size() {
        // 4 KiB pages: the 16 KiB slots are whole pages already.
        assert_eq!(
            page_span(3 * SLOT_ALIGN, SLOT_ALIGN, 4096, 8 * SLOT_ALIGN),
            (3 * SLOT_ALIGN, SLOT_ALIGN)
        );
        // 64 KiB pages: a slot inside a page backs the page; one across two, both; never past the mapping.
        let page = 64 << 10;
        assert_eq!(page_span(3 * SLOT_ALIGN, SLOT_ALIGN, page, 8 * SLOT_ALIGN), (0, page));
        assert_eq!(
            page_span(3 * SLOT_ALIGN, 2 * SLOT_ALIGN, page, 8 * SLOT_ALIGN),
            (0, 2 * page)
        );
        assert_eq!(
            page_span(5 * SLOT_ALIGN, SLOT_ALIGN, page, 6 * SLOT_ALIGN),
            (page, page)
        );
    }

    #[test]
    fn prefault_backs_slots_without_changing_a_byte() {
        let mut slots = SlotBuf::allocate(4, SLOT_ALIGN * 3).unwrap();
        slots[1].as_mut_slice().fill(7);
        let pass = Prefault::new(slots.iter().rev()).unwrap();
        let mut told = 0;
        let backed = pass.run(|| false, || told += 1);
        // Linux 5.14+ backs every slot; older kernels and other systems back none.
        assert!(backed == 0 || backed == 4 * SLOT_ALIGN * 3, "{backed}");
        // Told once per slot backed.
        assert_eq!(told, backed / (SLOT_ALIGN * 3));
        for (i, s) in slots.iter().enumerate() {
            let want = if i == 1 { 7 } else { 0 };
            assert!(s.as_ref().iter().all(|&x| x == want), "slot {i}");
        }
        assert_eq!(
            pass.run(|| true, || panic!("nothing backed")),
            0,
            "a stopped pass backs nothing"
        );
        let other = SlotBuf::allocate(1, 10).unwrap();
        assert!(Prefault::new([&slots[0], &other[0]]).is_none());
        assert!(Prefault::new([]).is_none());
    }
}
