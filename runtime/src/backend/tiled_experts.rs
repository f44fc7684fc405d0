//! The cpu backend's expert records in the int8 kernels' 16-row tiles (`crate::cpu::tiled`): rewritten by the
//! expert store's I/O threads as each read lands (from a model directory, or a packed store in MLX's layout,
//! which every backend reads; the rewrite costs one pass over each record read, so only a prompt's chunks ask
//! for it), or stored tiled by `sluice convert --layout tiled`, so that every read, a decode step's too, lands
//! in the kernels' layout at no cost (only the int8 kernels and the reference backend read such a store).

use std::collections::HashMap;

use expert_store::RecordTransform;

use crate::cpu::{tiled, Isa, MatRef};
use crate::linear::WeightFormat;
use crate::weights::ExpertLayout;

/// One MoE layer's records: as stored, their matrices' shapes, and as tiled.
#[derive(Debug, Clone, Copy)]
struct LayerRecords {
    stored: ExpertLayout,
    tiled: ExpertLayout,
    inter: usize,
    hidden: usize,
}

/// Tiles the records of every MoE layer whose three matrices can all be tiled.
#[derive(Debug, Default)]
pub struct TiledExperts {
    layers: HashMap<usize, LayerRecords>,
    panel: u8,
}

/// The name a packed store's manifest gives records tiled in panels of `panel` (its `layout` field).
pub fn store_layout_name(panel: u8) -> String {
    format!("tiled-p{panel}")
}

/// The panel width of records a store holds under the layout `name`; `None`: not a tiled layout this build
/// reads.
pub fn stored_panel(name: &str) -> Option<u8> {
    let panel: u8 = name.strip_prefix("tiled-p")?.parse().ok()?;
    tiled::valid_panel(panel.into()).then_some(panel)
}

/// `layout`'s records as tiles in panels of `panel`: every matrix 4-bit with whole 32-column blocks per
/// group and whole 16-row tiles (so a tiled record has exactly the stored record's bytes and fits the slot its
/// reads fill), and `same_bits(group, rows, cols)` for each.
pub fn tiled_formats(
    panel: u8,
    layout: &ExpertLayout,
    inter: usize,
    hidden: usize,
    same_bits: impl Fn(usize, usize, usize) -> bool,
) -> Option<ExpertLayout> {
    let mut formats = layout.formats;
    for (f, (_, (rows, cols))) in formats.iter_mut().zip(layout.matrices(inter, hidden)) {
        match *f {
            WeightFormat::Affine {
                bits,
                group,
                scale_type,
            } if tiled::tiles(bits, group, cols) && rows % tiled::TILE_ROWS == 0 && same_bits(group, rows, cols) => {
                *f = WeightFormat::Tiled {
                    group,
                    scale_type,
                    panel,
                }
            }
            _ => return None,
        }
    }
    Some(ExpertLayout { formats, fused: false })
}

/// Where the matrices of a record in the `tiled` layout lie: gate, up and down one after the other from the
/// slot's start, `(offset, bytes)` each. Every tiled length is a multiple of 64 bytes, so each stays aligned
/// for the kernels' loads.
pub fn tiled_parts(tiled: &ExpertLayout, inter: usize, hidden: usize) -> Vec<(usize, usize)> {
    let mut at = 0;
    (tiled.matrices(inter, hidden).iter())
        .map(|&(f, (rows, cols))| {
            let len = f.part_bytes(rows, cols)[0];
            at += len;
            (at - len, len)
        })
        .collect()
}

impl TiledExperts {
    /// For `(layer, stored layout, intermediate size, hidden size)` of each MoE layer, with the kernels of
    /// `isa`, in panels of `panel`; layers that cannot be tiled, or whose stored layout `isa`'s row-major kernel
    /// would not compute to the tiled kernel's bits (records read as stored must give what tiled ones give),
    /// are left as stored.
    pub fn new(isa: Isa, panel: u8, layers: impl IntoIterator<Item = (usize, ExpertLayout, usize, usize)>) -> Self {
        Self::with_rule(panel, layers, |group, rows, cols| {
            crate::cpu::q8::stored_matches_tiled(isa, group, rows, cols)
        })
    }

    /// [`TiledExperts::new`] for a packed store, which may be read on another x86-64 CPU: a layer is tiled only
    /// where both `isa`'s and AVX2's row-major kernels give the tiled kernel's bits, so the store computes what
    /// the model directory does on either.
    pub fn for_store(
        isa: Isa,
        panel: u8,
        layers: impl IntoIterator<Item = (usize, ExpertLayout, usize, usize)>,
    ) -> Self {
        Self::with_rule(panel, layers, |group, rows, cols| {
            [isa, Isa::Avx2]
                .iter()
                .all(|&i| crate::cpu::q8::stored_matches_tiled(i, group, rows, cols))
        })
    }

    fn with_rule(
        panel: u8,
        layers: impl IntoIterator<Item = (usize, ExpertLayout, usize, usize)>,
        same_bits: impl Fn(usize, usize, usize) -> bool + Copy,
    ) -> Self {
        let layers = (layers.into_iter())
            .filter_map(|(layer, stored, inter, hidden)| {
                let tiled = tiled_formats(panel, &stored, inter, hidden, same_bits)?;
                Some((
                    layer,
                    LayerRecords {
                        stored,
                        tiled,
                        inter,
                        hidden,
                    },
                ))
            })
            .collect();
        Self { layers, panel }
    }

    /// The name of this tiling as a packed store's manifest gives it.
    pub fn store_layout_name(&self) -> String {
        store_layout_name(self.panel)
    }

    /// The layout `layer`'s records have once loaded (`None`: as stored).
    pub fn layout(&self, layer: usize) -> Option<ExpertLayout> {
        self.layers.get(&layer).map(|l| l.tiled)
    }

    /// Whether no layer is tiled.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl RecordTransform for TiledExperts {
    fn parts(&self, layer: usize, read: &[(usize, usize)]) -> Option<Vec<(usize, usize)>> {
        let l = self.layers.get(&layer)?;
        (read.len() == l.stored.record_parts()).then(|| tiled_parts(&l.tiled, l.inter, l.hidden))
    }

    fn apply(
        &self,
        layer: usize,
        record: &[u8],
        from: &[(usize, usize)],
        slot: &mut [u8],
        to: &[(usize, usize)],
    ) -> Result<(), String> {
        let l = self.layers.get(&layer).ok_or("no tiling for this layer")?;
        let parts = (from.iter())
            .map(|&(at, len)| record.get(at..at + len))
            .collect::<Option<Vec<&[u8]>>>()
            .ok_or("a part lies outside the record")?;
        let split = l.stored.split(&parts, |p, r| p.get(r)).map_err(|e| e.to_string())?;
        let (matrices, tiled) = (
            l.stored.matrices(l.inter, l.hidden),
            l.tiled.matrices(l.inter, l.hidden),
        );
        for (((&(format, (rows, cols)), &(into, _)), parts), &(at, len)) in
            matrices.iter().zip(&tiled).zip(&split).zip(to)
        {
            let WeightFormat::Tiled { panel, .. } = into else {
                return Err("a tiled layer's matrix is not tiled".into());
            };
            let want = format.part_bytes(rows, cols);
            if parts.iter().map(|p| p.len()).ne(want.iter().copied()) {
                return Err(format!("a {rows}×{cols} matrix's parts are not {want:?} bytes"));
            }
            let MatRef::Quant(q) = format.view(rows, cols, parts) else {
                return Err("not a quantized matrix".into());
            };
            let dst = slot
                .get_mut(at..at + len)
                .ok_or("a tiled matrix lies outside the slot")?;
            if !tiled::tile_into(&q, panel.into(), dst) {
                return Err(format!("a {rows}×{cols} matrix cannot be tiled"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use expert_store::OwnedBytes;

    use super::*;
    use crate::cpu::testutil::{encode, pack};
    use crate::cpu::{FloatType, Isa};

    const INTER: usize = 64;
    const HIDDEN: usize = 128;

    fn q4(group: usize, scale_type: FloatType) -> WeightFormat {
        WeightFormat::Affine {
            bits: 4,
            group,
            scale_type,
        }
    }

    /// The parts of a `[rows, cols]` 4-bit matrix with weights that differ by `seed`.
    fn matrix_parts(rows: usize, cols: usize, group: usize, st: FloatType, seed: usize) -> Vec<Vec<u8>> {
        let codes: Vec<u32> = (0..rows * cols).map(|i| ((i * 7 + seed + i / 9) % 16) as u32).collect();
        let s: Vec<f32> = (0..rows * cols / group)
            .map(|i| 0.01 * (i + seed) as f32 - 0.2)
            .collect();
        let b: Vec<f32> = (0..rows * cols / group)
            .map(|i| 0.3 - 0.02 * (i * seed % 7) as f32)
            .collect();
        vec![pack(4, &codes), encode(st, &s), encode(st, &b)]
    }

    /// A record as a slot holds it after its reads: `parts` one after the other at 64-byte boundaries,
    /// after a 64-byte lead; returns the slot and the parts' places.
    fn slot_of(parts: &[Vec<u8>]) -> (Vec<u8>, Vec<(usize, usize)>) {
        let mut slot = vec![0xaau8; 64];
        let mut places = Vec::new();
        for p in parts {
            places.push((slot.len(), p.len()));
            slot.extend_from_slice(p);
            slot.resize(slot.len().next_multiple_of(64), 0xaa);
        }
        (slot, places)
    }

    fn rows_of(l: &crate::linear::Linear) -> Vec<Vec<f32>> {
        (0..l.rows)
            .map(|r| {
                let mut row = vec![0f32; l.cols];
                l.mat().row(Isa::Scalar, r, &mut row);
                row
            })
            .collect()
    }

    #[test]
    fn tiled_records_hold_the_same_weights_as_stored_ones() {
        for (fused, group, st) in [
            (false, 64, FloatType::BF16),
            (true, 32, FloatType::F16),
            (false, 64, FloatType::F32),
        ] {
            let stored = ExpertLayout {
                formats: [q4(group, st); 3],
                fused,
            };
            let parts = match fused {
                // One [2·inter, hidden] gate/up matrix, gate rows first, then down.
                true => [
                    matrix_parts(2 * INTER, HIDDEN, group, st, 1),
                    matrix_parts(HIDDEN, INTER, group, st, 3),
                ]
                .concat(),
                false => [
                    matrix_parts(INTER, HIDDEN, group, st, 1),
                    matrix_parts(INTER, HIDDEN, group, st, 2),
                    matrix_parts(HIDDEN, INTER, group, st, 3),
                ]
                .concat(),
            };
            let (read, from) = slot_of(&parts);
            let as_read: Vec<OwnedBytes> = parts.iter().map(|p| OwnedBytes::from_vec(p.clone())).collect();
            let want = stored.linears(INTER, HIDDEN, &as_read).unwrap();

            for panel in [1, 4] {
                let t = TiledExperts::new(Isa::Avx2, panel, [(5, stored, INTER, HIDDEN)]);
                assert!(t.parts(4, &from).is_none(), "a layer without tiling is left as read");
                let to = t.parts(5, &from).unwrap();
                assert!(to.iter().all(|&(at, len)| at + len <= read.len() && at % 64 == 0));
                let mut slot = read.clone();
                t.apply(5, &read, &from, &mut slot, &to).unwrap();

                let slot = OwnedBytes::from_vec(slot);
                let tiled: Vec<OwnedBytes> = to.iter().map(|&(at, len)| slot.slice(at..at + len).unwrap()).collect();
                let got = t.layout(5).unwrap().linears(INTER, HIDDEN, &tiled).unwrap();
                for (name, (g, w)) in ["gate", "up", "down"].iter().zip(got.iter().zip(&want)) {
                    assert!(matches!(g.format, WeightFormat::Tiled { panel: p, .. } if p == panel));
                    let what = format!("fused {fused} g{group} {st:?} panels of {panel}: {name}");
                    assert_eq!(rows_of(g), rows_of(w), "{what}");
                }
            }
        }
    }

    #[test]
    fn only_records_that_tile_whole_are_tiled_and_bad_ones_are_errors() {
        let f = q4(64, FloatType::BF16);
        let ok = ExpertLayout {
            formats: [f; 3],
            fused: false,
        };
        let eight = ExpertLayout {
            formats: [
                f,
                WeightFormat::Affine {
                    bits: 8,
                    group: 64,
                    scale_type: FloatType::BF16,
                },
                f,
            ],
            fused: false,
        };
        // 8-bit up, a partial tile (gate and up rows) and groups that do not divide the columns (down's) stay
        // as stored.
        let t = TiledExperts::new(
            Isa::Avx2,
            4,
            [(0, ok, INTER, HIDDEN), (1, eight, INTER, HIDDEN), (2, ok, 40, HIDDEN)],
        );
        assert!(t.layout(0).is_some() && t.layout(1).is_none() && t.layout(2).is_none());

        // A store tiles only what every x86-64 kernel computes alike: 96 columns in groups of 32 are whole
        // tiles and one AVX-512 band step, but not whole 64-column chunks of the AVX2 row-major kernel.
        let g32 = ExpertLayout {
            formats: [q4(32, FloatType::BF16); 3],
            fused: false,
        };
        let tiled = |t: TiledExperts| t.layout(0).is_some();
        assert!(!tiled(TiledExperts::new(Isa::Avx2, 1, [(0, g32, INTER, 96)])));
        assert!(!tiled(TiledExperts::for_store(Isa::Avx512, 1, [(0, g32, INTER, 96)])));
        assert!(tiled(TiledExperts::for_store(
            Isa::Avx512,
            1,
            [(0, g32, INTER, HIDDEN)]
        )));

        // A record whose parts are short is an error, not a panic.
        let parts = [
            matrix_parts(INTER, HIDDEN, 64, FloatType::BF16, 1),
            matrix_parts(INTER, HIDDEN, 64, FloatType::BF16, 2),
            matrix_parts(HIDDEN, INTER, 64, FloatType::BF16, 3),
        ]
        .concat();
        let (read, mut from) = slot_of(&parts);
        from[4].1 -= 2;
        let to = t.parts(0, &from).unwrap();
        let err = t.apply(0, &read, &from, &mut read.clone(), &to).unwrap_err();
        assert!(err.contains("64×128"), "{err}");
        assert!(
            t.parts(0, &from[..8]).is_none(),
            "a record with too few parts is left as read"
        );
    }
}
