//! 4-bit affine matrices repacked for the int8 kernels: 16 rows interleaved per tile, so one linear stream
//! feeds 16 rows at once and each 32-bit lane of an integer dot product sums one row's whole 32-column
//! activation block. The float work (block scale × group scale, accumulate) is then one vector op per 16 rows
//! and block, where MLX's row-major layout needs one per row and 128 columns.
//!
//! Layout: tiles (rows `16t .. 16t+16`; a short last tile is padded with zero rows) come in panels of `panel` tiles (1
//! or 4; the last panel may have fewer), and a panel is stored group by group, its tiles side by side (in panels of
//! four: group 0 of tiles 0..4, then group 1 of tiles 0..4, and so on). A panel of one tile is the plain tile-major
//! order. The decode kernels read four tiles side by side, so with panels of four they read one sequential stream per
//! matrix, which AMD's prefetchers follow from panel to panel (measured on an AMD EPYC: 10–30% more weight bytes per
//! second than four streams), while with panels of one they read four streams at once, which keeps more lines in flight
//! on Intel cores (medium decode +18% on the Sapphire Rapids host); [`super::panel_tiles`] picks by CPU. The layout
//! moves bytes, never arithmetic: both give the same bits. One tile's group is its 16 scales, its 16 biases (in the
//! stored float type), then for each 32-column block of the group 256 bytes of codes: 64-byte vector `k` (0..4) holds,
//! in bytes `4l .. 4l+4` (lane `l`, row `16t + l`), the codes of columns `4k + j` (low nibbles) and `16 + 4k + j` (high
//! nibbles) of the block.

use super::{FloatType, QuantMatrix};

/// Rows per tile.
pub const TILE_ROWS: usize = 16;
/// Tiles the decode kernels read side by side, and the widest panel.
pub const PASS_TILES: usize = 4;
/// Rows of [`PASS_TILES`] tiles: where a tiled matrix may be split between threads (whatever its panels).
pub const PASS_ROWS: usize = PASS_TILES * TILE_ROWS;
/// Columns per block (one activation quantization block).
const BLOCK: usize = 32;
/// Code bytes per tile and block.
const BLOCK_BYTES: usize = TILE_ROWS * BLOCK / 2;

/// A tiled 4-bit matrix `[rows, cols]` viewed in place.
#[derive(Debug, Clone, Copy)]
pub struct TiledMatrix<'a> {
    /// The tiles (see the module docs), `tiled_len(..)` bytes.
    pub data: &'a [u8],
    /// Element type of scales and biases.
    pub scale_type: FloatType,
    /// Columns per scale/bias group (a multiple of 32).
    pub group: usize,
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of `group`).
    pub cols: usize,
    /// Tiles per panel: 1 or [`PASS_TILES`] (see the module docs).
    pub panel: usize,
}

/// Bytes of one group of one tile: scales, biases, codes.
pub fn group_bytes(group: usize, scale_type: FloatType) -> usize {
    2 * TILE_ROWS * scale_type.size() + group / BLOCK * BLOCK_BYTES
}

/// Bytes a tiled `[rows, cols]` matrix takes.
pub fn tiled_len(rows: usize, cols: usize, group: usize, scale_type: FloatType) -> usize {
    rows.div_ceil(TILE_ROWS) * (cols / group) * group_bytes(group, scale_type)
}

/// Where group `g` of tile `t` starts in a matrix of `tiles` tiles with `groups` groups of `gb` bytes, in
/// panels of `panel` tiles, and the distance from one group of that tile to its next (its panel's tiles side
/// by side).
pub fn tile_group_at(tiles: usize, groups: usize, gb: usize, panel: usize, t: usize, g: usize) -> (usize, usize) {
    let first = t - t % panel;
    let stride = (tiles - first).min(panel) * gb;
    (first * groups * gb + g * stride + (t - first) * gb, stride)
}

/// Whether `panel` is a panel width the kernels read: 1 or [`PASS_TILES`].
pub fn valid_panel(panel: usize) -> bool {
    panel == 1 || panel == PASS_TILES
}

/// Whether `q` can be tiled: 4-bit, groups of whole blocks, whole groups per row.
pub fn can_tile(q: &QuantMatrix<'_>) -> bool {
    tiles(q.bits, q.group, q.cols)
}

/// Whether a matrix of `cols` columns, `bits`-bit in groups of `group`, can be tiled.
pub fn tiles(bits: u32, group: usize, cols: usize) -> bool {
    // MLX's group sizes, each whole blocks of at most 128 columns: the row-major band kernel then gives a tiled
    // matrix's bits. Other sizes (96 would tile) run the exact kernels, as the row-major int8 kernels do.
    bits == 4 && matches!(group, 32 | 64 | 128) && group.is_multiple_of(BLOCK) && cols.is_multiple_of(group)
}

/// `q` repacked into tiles in panels of `panel`, or `None` when [`can_tile`] or [`valid_panel`] says no.
pub fn tile(q: &QuantMatrix<'_>, panel: usize) -> Option<Vec<u8>> {
    let mut out = vec![0u8; tiled_len(q.rows, q.cols, q.group, q.scale_type)];
    tile_into(q, panel, &mut out).then_some(out)
}

/// Writes `q`'s tiles in panels of `panel` into `out` (`tiled_len(..)` bytes, every byte written); false
/// when [`can_tile`] or [`valid_panel`] says no or `out` has the wrong length.
pub fn tile_into(q: &QuantMatrix<'_>, panel: usize, out: &mut [u8]) -> bool {
    if !can_tile(q) || !valid_panel(panel) || out.len() != tiled_len(q.rows, q.cols, q.group, q.scale_type) {
        return false;
    }
    let size = q.scale_type.size();
    let (groups, gb) = (q.cols / q.group, group_bytes(q.group, q.scale_type));
    let row_bytes = q.cols / 2;
    let tiles = q.rows.div_ceil(TILE_ROWS);
    for first in (0..tiles).step_by(PASS_TILES) {
        // Four tiles at a time, group by group: with panels of four, the order the panel is stored in, so the
        // writes run straight through it (tile by tile, they hopped a panel's width at each group, and a
        // record fresh from disk tiled at half the speed); with panels of one, four streams of writes.
        let pass = first..tiles.min(first + PASS_TILES);
        // Each tile's rows of codes, scales and biases; padding rows (and tiles past the last) are empty.
        let rows = |part, i: usize, len| tile_rows(part, (first + i) * TILE_ROWS, q.rows, len);
        let parts: [_; PASS_TILES] = std::array::from_fn(|i| {
            [
                rows(q.packed, i, row_bytes),
                rows(q.scales, i, groups * size),
                rows(q.biases, i, groups * size),
            ]
        });
        // The next four tiles' rows, fetched a group's share at a time while these are tiled: a record being
        // tiled has just landed from disk, and four tiles read their 64 rows side by side.
        let next = |part, len| rows_span(part, (first + PASS_TILES) * TILE_ROWS, q.rows, len);
        let next_codes = next(q.packed, row_bytes);
        prefetch(next(q.scales, groups * size));
        prefetch(next(q.biases, groups * size));
        let share = next_codes.len().div_ceil(groups.max(1)).next_multiple_of(64).max(64);
        // Tiles whose rows all exist (all but a short last one), in one call per pass where the CPU has one.
        #[cfg(target_arch = "x86_64")]
        {
            let n = pass.len();
            let places: [_; PASS_TILES] =
                std::array::from_fn(|i| tile_group_at(tiles, groups, gb, panel, pass.start + i.min(n - 1), 0));
            if super::x86::tile_pass_full(
                &parts[..n],
                q.scale_type,
                q.group,
                &places[..n],
                out,
                (next_codes, share),
            ) {
                continue;
            }
        }
        for g in 0..groups {
            prefetch(next_codes.chunks(share).nth(g).unwrap_or_default());
            for (t, [codes, scales, biases]) in pass.clone().zip(&parts) {
                let at = tile_group_at(tiles, groups, gb, panel, t, g).0;
                let (params, dst) = out[at..at + gb].split_at_mut(2 * TILE_ROWS * size);
                let (s, b) = params.split_at_mut(TILE_ROWS * size);
                match size {
                    2 => (copy_params::<2>(scales, g, s), copy_params::<2>(biases, g, b)),
                    _ => (copy_params::<4>(scales, g, s), copy_params::<4>(biases, g, b)),
                };
                tile_blocks(codes, g * q.group / 2, dst);
            }
        }
    }
    true
}

/// The bytes of rows `first .. first + 64` of `part` (`len` bytes each, `rows` rows; fewer at the end).
fn rows_span(part: &[u8], first: usize, rows: usize, len: usize) -> &[u8] {
    let (first, end) = (first.min(rows), (first + PASS_ROWS).min(rows));
    part.get(first * len..end * len).unwrap_or_default()
}

/// Rows `first .. first + 16` of `part` (`len` bytes each); rows at or past `rows` are empty.
fn tile_rows(part: &[u8], first: usize, rows: usize, len: usize) -> [&[u8]; TILE_ROWS] {
    std::array::from_fn(|l| match first + l < rows {
        true => part.get((first + l) * len..(first + l + 1) * len).unwrap_or_default(),
        false => &[],
    })
}

/// Group `g`'s scale (or bias) of each of a tile's rows, `S` bytes each, into `dst` (zero for padding rows).
fn copy_params<const S: usize>(rows: &[&[u8]; TILE_ROWS], g: usize, dst: &mut [u8]) {
    for (d, r) in dst.chunks_exact_mut(S).zip(rows) {
        let v: [u8; S] = r
            .get(g * S..(g + 1) * S)
            .and_then(|v| v.try_into().ok())
            .unwrap_or([0; S]);
        d.copy_from_slice(&v);
    }
}

/// Asks for `bytes` to be brought into the caches (a no-op where there is no prefetch instruction).
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    super::x86::prefetch_lines(bytes);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// A tile's 32-column blocks from row-major codes: block `b` of `dst` (256 bytes each) from bytes
/// `at + 16b .. at + 16b + 16` of each of the 16 rows (zeros where a row is shorter: padding rows are empty).
fn tile_blocks(rows: &[&[u8]; TILE_ROWS], at: usize, dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    super::x86::tile_blocks(rows, at, dst);
    #[cfg(not(target_arch = "x86_64"))]
    tile_blocks_scalar(rows, at, dst);
}

/// [`tile_blocks`] through a gathered block at a time.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))] // the x86-64 build's oracle for its SSE2 and AVX2 paths
fn tile_blocks_scalar(rows: &[&[u8]; TILE_ROWS], at: usize, dst: &mut [u8]) {
    for (b, block) in dst.chunks_exact_mut(BLOCK_BYTES).enumerate() {
        let mut src = [0u8; BLOCK_BYTES];
        for (row, codes) in src.chunks_exact_mut(16).zip(rows) {
            if let Some(c) = codes.get(at + 16 * b..at + 16 * b + 16) {
                row.copy_from_slice(c);
            }
        }
        tile_block_scalar(&src, block.try_into().expect("a block is 256 bytes"));
    }
}

/// One tile's 32-column block, a row and a 4-byte word at a time: `src` holds each of the 16 rows' 16
/// row-major code bytes, one after the other.
fn tile_block_scalar(src: &[u8; BLOCK_BYTES], dst: &mut [u8; BLOCK_BYTES]) {
    for (l, row) in src.chunks_exact(16).enumerate() {
        // Byte 4k+j of a row goes to vector k, lane l.
        for (k, word) in interleave_block(row).chunks_exact(4).enumerate() {
            dst[64 * k + 4 * l..][..4].copy_from_slice(word);
        }
    }
}

/// One row's 32-column block from row-major codes (byte `i`: column `2i` low, `2i+1` high) to tiled order
/// (byte `m`: column `m` low, `16 + m` high), eight bytes at a time.
fn interleave_block(src: &[u8]) -> [u8; 16] {
    const LOW: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    let word = |b: &[u8]| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let (lo, hi) = (word(&src[..8]), word(&src[8..16]));
    // Byte i of `even` is output byte 2i (columns 2i and 16+2i); of `odd`, output byte 2i+1.
    let even = (lo & LOW) | ((hi & LOW) << 4);
    let odd = ((lo >> 4) & LOW) | (hi & !LOW);
    // Spread each u64's bytes to the even bytes of a u128.
    let spread = |x: u64| {
        let x = x as u128;
        let x = (x | (x << 32)) & 0x0000_0000_ffff_ffff_0000_0000_ffff_ffff;
        let x = (x | (x << 16)) & 0x0000_ffff_0000_ffff_0000_ffff_0000_ffff;
        (x | (x << 8)) & 0x00ff_00ff_00ff_00ff_00ff_00ff_00ff_00ff
    };
    (spread(even) | (spread(odd) << 8)).to_le_bytes()
}

impl TiledMatrix<'_> {
    /// Row `r` dequantized to f32 (`out.len() == cols`).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let (size, gb) = (self.scale_type.size(), group_bytes(self.group, self.scale_type));
        let (tiles, groups) = (self.rows.div_ceil(TILE_ROWS), self.cols / self.group);
        let l = r % TILE_ROWS;
        for (g, dst) in out.chunks_mut(self.group).enumerate() {
            let at = tile_group_at(tiles, groups, gb, self.panel, r / TILE_ROWS, g).0;
            let grp = &self.data[at..at + gb];
            let s = self.scale_type.get(grp, l);
            let b = self.scale_type.get(grp, TILE_ROWS + l);
            let codes = &grp[2 * TILE_ROWS * size..];
            for (kb, blk) in dst.chunks_mut(BLOCK).enumerate() {
                for (c, o) in blk.iter_mut().enumerate() {
                    let (k, j, high) = ((c % 16) / 4, c % 4, c >= 16);
                    let byte = codes[kb * BLOCK_BYTES + 64 * k + 4 * l + j];
                    let q = if high { byte >> 4 } else { byte & 0x0f };
                    *o = s * q as f32 + b;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{encode, pack};
    use crate::cpu::{Isa, MatRef};

    #[test]
    fn the_simd_block_transform_equals_the_scalar_one() {
        // Rows of different lengths (full, empty as padding rows are, and ending inside or between blocks),
        // read from offsets that are and are not multiples of 16; every other seed has all 16 rows whole,
        // as a full tile does (with AVX2, two blocks at a time).
        for seed in 0..50u32 {
            let byte = |i: usize| ((i as u32).wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) as u8;
            let (blocks, at) = (1 + seed as usize % 5, [0, 16, 7][seed as usize % 3]);
            let full = at + 16 * blocks;
            let data: Vec<Vec<u8>> = (0..TILE_ROWS)
                .map(|l| {
                    let len = match (l + seed as usize) % 7 {
                        _ if seed % 2 == 0 => full + l,
                        0 => 0,
                        1 => full - 16,
                        2 => full - 5,
                        _ => full + l,
                    };
                    (0..len).map(|i| byte(i + 1000 * l)).collect()
                })
                .collect();
            let rows: [&[u8]; TILE_ROWS] = std::array::from_fn(|l| data[l].as_slice());
            let (mut a, mut b) = (vec![0xaau8; blocks * BLOCK_BYTES], vec![0x55u8; blocks * BLOCK_BYTES]);
            tile_blocks(&rows, at, &mut a);
            tile_blocks_scalar(&rows, at, &mut b);
            assert_eq!(a, b, "seed {seed}");
        }
    }

    #[test]
    fn a_matrix_without_columns_tiles_to_nothing() {
        let q = QuantMatrix {
            packed: &[],
            scales: &[],
            biases: &[],
            scale_type: FloatType::BF16,
            bits: 4,
            group: 64,
            rows: 70,
            cols: 0,
        };
        assert_eq!(tile(&q, PASS_TILES), Some(Vec::new()));
        assert_eq!(tile(&q, 2), None, "panels of two are no layout the kernels read");
    }

    #[test]
    fn every_tile_group_has_its_own_bytes() {
        let gb = 64;
        for panel in [1, PASS_TILES] {
            for (tiles, groups) in [(1, 1), (4, 3), (5, 2), (11, 4), (8, 1), (7, 5)] {
                let mut owner = vec![usize::MAX; tiles * groups * gb];
                for t in 0..tiles {
                    for g in 0..groups {
                        let (at, stride) = tile_group_at(tiles, groups, gb, panel, t, g);
                        assert!(
                            owner[at..at + gb].iter().all(|&o| o == usize::MAX),
                            "{tiles}×{groups} in panels of {panel}: overlap"
                        );
                        owner[at..at + gb].fill(t * groups + g);
                        // A group's next one is `stride` further on, and a panel's tiles sit side by side.
                        if g + 1 < groups {
                            assert_eq!(tile_group_at(tiles, groups, gb, panel, t, g + 1).0, at + stride);
                        }
                        if t % panel > 0 {
                            assert_eq!(tile_group_at(tiles, groups, gb, panel, t - 1, g).0 + gb, at);
                        }
                    }
                }
                assert!(owner.iter().all(|&o| o != usize::MAX), "{tiles}×{groups}: a gap");
                // Panels of one are tile-major: each tile whole, one after another.
                if panel == 1 {
                    assert!((0..tiles).all(|t| tile_group_at(tiles, groups, gb, 1, t, 0) == (t * groups * gb, gb)));
                }
            }
        }
    }

    #[test]
    fn a_tiled_matrix_dequantizes_to_the_same_rows() {
        for &(rows, cols, group, st) in &[
            (16usize, 64usize, 64usize, FloatType::BF16),
            (37, 256, 32, FloatType::F16),
            (5, 128, 128, FloatType::F32),
            // Two panels, the second of one tile.
            (80, 64, 32, FloatType::BF16),
            // Whole tiles (the one-call-per-pass path where the CPU has it): groups of one block, of four,
            // four-byte scales, and a matrix of passes and a short last panel.
            (64, 96, 32, FloatType::F16),
            (64, 256, 128, FloatType::F32),
            (112, 192, 64, FloatType::BF16),
        ] {
            let codes: Vec<u32> = (0..rows * cols).map(|i| ((i * 7 + i / 5) % 16) as u32).collect();
            let s: Vec<f32> = (0..rows * cols / group).map(|i| 0.01 * i as f32 - 0.3).collect();
            let b: Vec<f32> = (0..rows * cols / group).map(|i| 0.5 - 0.02 * i as f32).collect();
            let (packed, scales, biases) = (pack(4, &codes), encode(st, &s), encode(st, &b));
            let q = QuantMatrix {
                packed: &packed,
                scales: &scales,
                biases: &biases,
                scale_type: st,
                bits: 4,
                group,
                rows,
                cols,
            };
            for panel in [1, PASS_TILES] {
                let data = tile(&q, panel).unwrap();
                // Into a slot that held something else: every byte is written, padding rows included.
                let mut dirty = vec![0xaa; data.len()];
                assert!(tile_into(&q, panel, &mut dirty) && dirty == data);
                let t = TiledMatrix {
                    data: &data,
                    scale_type: st,
                    group,
                    rows,
                    cols,
                    panel,
                };
                let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
                for r in 0..rows {
                    MatRef::Quant(q).row(Isa::Scalar, r, &mut want);
                    t.row(r, &mut got);
                    assert_eq!(want, got, "row {r} of {rows}×{cols} g{group}, panels of {panel}");
                }
            }
        }
    }
}
