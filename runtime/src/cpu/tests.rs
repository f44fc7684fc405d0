use proptest::prelude::*;

use super::testutil::{encode, pack};
use super::*;

#[derive(Debug)]
struct Case {
    packed: Vec<u8>,
    scales: Vec<u8>,
    biases: Vec<u8>,
    st: FloatType,
    bits: u32,
    group: usize,
    rows: usize,
    cols: usize,
}

impl Case {
    fn mat(&self) -> MatRef<'_> {
        MatRef::Quant(QuantMatrix {
            packed: &self.packed,
            scales: &self.scales,
            biases: &self.biases,
            scale_type: self.st,
            bits: self.bits,
            group: self.group,
            rows: self.rows,
            cols: self.cols,
        })
    }
}

fn case_strategy() -> impl Strategy<Value = (Case, Vec<f32>, usize)> {
    (
        prop::sample::select(vec![2u32, 3, 4, 5, 6, 8]),
        prop::sample::select(vec![32usize, 64, 128]),
        1usize..24,
        // Up to 45 groups: a real width such as gpt-oss's 2880 (45 × 64), whose last step is short.
        prop::sample::select(vec![1usize, 2, 3, 45]),
        // 4 and more tokens too: the kernels take four at a time, then the rest.
        1usize..10,
        prop::sample::select(vec![FloatType::F32, FloatType::F16, FloatType::BF16]),
        any::<u64>(),
    )
        .prop_map(|(bits, group, rows, ngroups, n, st, seed)| {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let cols = group * ngroups;
            let codes: Vec<u32> = (0..rows * cols).map(|_| rng.gen_range(0..(1u32 << bits))).collect();
            // Negative scales are legal (the quantizer flips them when |min| ≤ |max|).
            let s: Vec<f32> = (0..rows * ngroups).map(|_| rng.gen_range(-0.1f32..0.1)).collect();
            let b: Vec<f32> = (0..rows * ngroups).map(|_| rng.gen_range(-1f32..1.0)).collect();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-2f32..2.0)).collect();
            let case = Case {
                packed: pack(bits, &codes),
                scales: encode(st, &s),
                biases: encode(st, &b),
                st,
                bits,
                group,
                rows,
                cols,
            };
            (case, x, n)
        })
}

/// Tolerance for one output: float reassociation error is bounded by a few ulps of Σ|w·x|.
fn tolerance(w: &MatRef<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (w.rows(), w.cols());
    let mut row = vec![0f32; cols];
    let mut tol = vec![0f32; n * rows];
    for r in 0..rows {
        w.row(Isa::Scalar, r, &mut row);
        for t in 0..n {
            let mag: f32 = row
                .iter()
                .zip(&x[t * cols..(t + 1) * cols])
                .map(|(a, b)| (a * b).abs())
                .sum();
            tol[t * rows + r] = 1e-5 * mag + 1e-6;
        }
    }
    tol
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_isa_matches_the_scalar_reference((case, x, n) in case_strategy()) {
        let w = case.mat();
        let mut want = vec![0f32; n * case.rows];
        reference_matmul(&w, &x, n, &mut want);
        let tol = tolerance(&w, &x, n);
        for isa in Isa::available() {
            let mut got = vec![0f32; n * case.rows];
            w.matmul(isa, &x, n, &mut got);
            for i in 0..got.len() {
                prop_assert!((got[i] - want[i]).abs() <= tol[i], "{isa:?} bits {} group {} [{i}]: {} vs {}",
                    case.bits, case.group, got[i], want[i]);
            }
        }
    }

    #[test]
    fn simd_unpack_is_exact((case, _x, _n) in case_strategy()) {
        let mut want = vec![0f32; case.cols];
        scalar::unpack(case.bits, &case.packed, &mut want);
        for isa in Isa::available() {
            let mut got = vec![0f32; case.cols];
            isa.unpack(case.bits, &case.packed, &mut got);
            prop_assert_eq!(&got, &want);
        }
    }

    #[test]
    fn simd_dot_matches_scalar(v in prop::collection::vec(-4f32..4.0, 0..300)) {
        let (a, b) = v.split_at(v.len() / 2);
        let b = &b[..a.len()];
        let want = scalar::dot(a, b);
        let mag: f32 = a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum();
        for isa in Isa::available() {
            prop_assert!((isa.dot(a, b) - want).abs() <= 1e-5 * mag + 1e-6);
        }
    }

    #[test]
    fn attention_kernels_are_the_same_bits_on_every_isa(
        heads in 1usize..20,
        hd in prop::sample::select(vec![2usize, 8, 16, 40, 48, 64, 80, 96, 128, 136, 256]),
        visible in prop::sample::select(vec![0usize, 1, 3, 15, 16, 17, 39, 63, 64, 65, 130, 200]),
        extra in 0usize..20,
        pad in 0usize..5,
        cut in 0f64..1.0,
        f16 in any::<bool>(),
        seed in 0u32..1000,
    ) {
        use kv::{KvHead, KvType};
        let val = |i: usize| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0;
        // More positions than visible: the kernels must stop at `visible`.
        let mut cache = KvHead::new(if f16 { KvType::F16 } else { KvType::F32 }, hd);
        for p in 0..visible + extra {
            let row = |s: usize| (0..hd).map(|c| val(s + p * hd + c)).collect::<Vec<f32>>();
            cache.push(&row(0), &row(1 << 20));
        }
        let q: Vec<f32> = (0..heads * hd).map(|i| val(i + 7)).collect();
        // Weight rows `stride` apart, longer than the rows summed.
        let stride = visible + pad;
        let w: Vec<f32> = (0..heads * stride).map(|i| val(i + 11)).collect();
        let start: Vec<f32> = (0..heads * hd).map(|i| val(i + 13)).collect();
        let (mut want_s, mut want_o) = (vec![0f32; heads * visible], start.clone());
        Isa::Scalar.key_scores(&q, cache.keys(), hd, visible, 0.125, &mut want_s);
        Isa::Scalar.weighted_values(&mut want_o, &w, stride, 0..visible, cache.values(), hd);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // The rows in two calls: the chains carry on where the first call left them.
        let cut = (cut * visible as f64) as usize;
        for isa in Isa::available() {
            let (mut s, mut o) = (vec![0f32; heads * visible], start.clone());
            isa.key_scores(&q, cache.keys(), hd, visible, 0.125, &mut s);
            isa.weighted_values(&mut o, &w, stride, 0..cut, cache.values(), hd);
            isa.weighted_values(&mut o, &w, stride, cut..visible, cache.values(), hd);
            prop_assert_eq!(bits(&s), bits(&want_s), "{:?} scores", isa);
            prop_assert_eq!(bits(&o), bits(&want_o), "{:?} weighted values, cut at {}", isa, cut);
        }
    }

    #[test]
    fn attention_kernels_compute_the_products(
        heads in 1usize..5,
        hd in prop::sample::select(vec![2usize, 16, 24]),
        visible in 1usize..40,
    ) {
        use kv::{KvHead, KvType};
        // Against plain f64 sums over rows as pushed: the block layout is read back in the right order.
        let (ks, vs): (Vec<f32>, Vec<f32>) = (0..visible * hd).map(|i| (((i * 7) % 11) as f32 - 5.0, ((i * 5) % 13) as f32 - 6.0)).unzip();
        let mut cache = KvHead::new(KvType::F32, hd);
        for p in 0..visible {
            cache.push(&ks[p * hd..(p + 1) * hd], &vs[p * hd..(p + 1) * hd]);
        }
        let q: Vec<f32> = (0..heads * hd).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
        let w: Vec<f32> = (0..heads * visible).map(|i| ((i * 5) % 9) as f32 - 4.0).collect();
        for isa in Isa::available() {
            let mut s = vec![0f32; heads * visible];
            isa.key_scores(&q, cache.keys(), hd, visible, 0.5, &mut s);
            let mut o = vec![0f32; heads * hd];
            isa.weighted_values(&mut o, &w, visible, 0..visible, cache.values(), hd);
            for g in 0..heads {
                for j in 0..visible {
                    let want: f64 = (0..hd).map(|d| q[g * hd + d] as f64 * ks[j * hd + d] as f64).sum::<f64>() * 0.5;
                    prop_assert_eq!(s[g * visible + j] as f64, want, "{:?} score {} {}", isa, g, j);
                }
                for c in 0..hd {
                    let want: f64 = (0..visible).map(|j| w[g * visible + j] as f64 * vs[j * hd + c] as f64).sum();
                    prop_assert_eq!(o[g * hd + c] as f64, want, "{:?} value {} {}", isa, g, c);
                }
            }
        }
    }

    #[test]
    fn softmax_is_the_same_bits_on_every_isa(v in prop::collection::vec(-120f32..30.0, 0..300)) {
        let mut want = v.clone();
        scalar::softmax(&mut want);
        for isa in Isa::available() {
            let mut got = v.clone();
            isa.softmax(&mut got);
            prop_assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{:?}, length {}", isa, v.len()
            );
        }
    }

    #[test]
    fn swiglu_is_the_same_bits_on_every_isa_and_matches_f64(
        gu in prop::collection::vec((-90f32..90.0, -4f32..4.0), 0..70)
    ) {
        let (g, u): (Vec<f32>, Vec<f32>) = gu.into_iter().unzip();
        let mut want = g.clone();
        scalar::swiglu(&mut want, &u);
        for isa in Isa::available() {
            let mut got = g.clone();
            isa.swiglu(&mut got, &u);
            prop_assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{:?}, length {}", isa, g.len()
            );
        }
        for ((w, g), u) in want.iter().zip(&g).zip(&u) {
            let exact = *g as f64 / (1.0 + (-*g as f64).exp()) * *u as f64;
            // The absolute floor covers gates past `EXP_HI`, which give −0 where the exact value is ~3e-37.
            prop_assert!((*w as f64 - exact).abs() <= 1e-6 * exact.abs() + 2e-36, "{} vs {}", w, exact);
        }
    }

    #[test]
    fn softmax_matches_f64(v in prop::collection::vec(-30f32..30.0, 1..300)) {
        let mut got = v.clone();
        Isa::detect().softmax(&mut got);
        let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = v.iter().map(|&x| (x as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        for (g, e) in got.iter().zip(&e) {
            let want = e / s;
            prop_assert!((*g as f64 - want).abs() <= 2e-6 * want + 1e-12, "{} vs {}", g, want);
        }
    }

    #[test]
    fn batched_rows_equal_single_token_calls_bit_for_bit((case, x, n) in case_strategy()) {
        let w = case.mat();
        let isa = Isa::detect();
        let mut batched = vec![0f32; n * case.rows];
        w.matmul(isa, &x, n, &mut batched);
        for t in 0..n {
            let mut one = vec![0f32; case.rows];
            w.matmul(isa, &x[t * case.cols..(t + 1) * case.cols], 1, &mut one);
            prop_assert_eq!(&one[..], &batched[t * case.rows..(t + 1) * case.rows]);
        }
    }
}

#[test]
fn bit_stream_layout_matches_mlx_for_3_and_6_bits() {
    // §2.3: 3-bit e0=b0&7, e1=(b0>>3)&7, e2=(b0>>6)|((b1&1)<<2); 6-bit e0=b0&63, e1=(b0>>6)|((b1&15)<<2).
    let bytes = [0b1011_0101u8, 0b0110_1101, 0b1100_0011];
    let mut c3 = [0f32; 8];
    scalar::unpack(3, &bytes, &mut c3);
    assert_eq!(c3[0] as u8, bytes[0] & 7);
    assert_eq!(c3[1] as u8, (bytes[0] >> 3) & 7);
    assert_eq!(c3[2] as u8, (bytes[0] >> 6) | ((bytes[1] & 1) << 2));
    let mut c6 = [0f32; 4];
    scalar::unpack(6, &bytes, &mut c6);
    assert_eq!(c6[0] as u8, bytes[0] & 63);
    assert_eq!(c6[1] as u8, (bytes[0] >> 6) | ((bytes[1] & 15) << 2));
    assert_eq!(c6[2] as u8, (bytes[1] >> 4) | ((bytes[2] & 3) << 4));
    assert_eq!(c6[3] as u8, bytes[2] >> 2);
}

#[test]
fn negative_scale_row_dequantizes_like_mlx() {
    // MLX quantizes 0..15 at 4 bits as scale -1, bias 15, codes 15..0.
    let codes: Vec<u32> = (0..32).map(|k| 15 - (k % 16)).collect();
    let packed = pack(4, &codes);
    let scales = encode(FloatType::BF16, &[-1.0]);
    let biases = encode(FloatType::BF16, &[15.0]);
    let w = MatRef::Quant(QuantMatrix {
        packed: &packed,
        scales: &scales,
        biases: &biases,
        scale_type: FloatType::BF16,
        bits: 4,
        group: 32,
        rows: 1,
        cols: 32,
    });
    let mut row = vec![0f32; 32];
    w.row(Isa::detect(), 0, &mut row);
    let want: Vec<f32> = (0..32).map(|k| (k % 16) as f32).collect();
    assert_eq!(row, want);
}

#[test]
fn large_matmul_is_identical_across_thread_counts() {
    let rows = 300;
    let cols = 256;
    let codes: Vec<u32> = (0..rows * cols).map(|i| (i * 7 % 16) as u32).collect();
    let packed = pack(4, &codes);
    let s: Vec<f32> = (0..rows * 4).map(|i| (i as f32 * 0.37).sin() * 0.05).collect();
    let b: Vec<f32> = (0..rows * 4).map(|i| (i as f32 * 0.11).cos()).collect();
    let (scales, biases) = (encode(FloatType::F32, &s), encode(FloatType::F32, &b));
    let w = MatRef::Quant(QuantMatrix {
        packed: &packed,
        scales: &scales,
        biases: &biases,
        scale_type: FloatType::F32,
        bits: 4,
        group: 64,
        rows,
        cols,
    });
    let x: Vec<f32> = (0..3 * cols).map(|i| (i as f32 * 0.01).sin()).collect();
    let mut a = vec![0f32; 3 * rows];
    w.matmul(Isa::detect(), &x, 3, &mut a);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let mut b1 = vec![0f32; 3 * rows];
    pool.install(|| w.matmul(Isa::detect(), &x, 3, &mut b1));
    assert_eq!(a, b1);
}

/// Outputs come back token-major whatever the row and token counts (partial blocks of 16 tokens and 64 rows).
#[test]
fn untranspose_puts_each_output_where_the_plain_loop_does() {
    for (rows, n) in [(0, 3), (1, 1), (5, 17), (64, 16), (130, 33), (7, 40)] {
        let yt: Vec<f32> = (0..rows * n).map(|i| i as f32).collect();
        for parallel in [false, true] {
            let mut y = vec![-1f32; rows * n];
            untranspose(&yt, n, &mut y, parallel);
            for r in 0..rows {
                for t in 0..n {
                    assert_eq!(y[t * rows + r], yt[r * n + t], "rows {rows}, n {n}, row {r}, token {t}");
                }
            }
        }
    }
}

/// Int8-activation kernels against their oracle: same quantized activations, exact integer block sums.
#[cfg(target_arch = "x86_64")]
mod q8_kernels {
    use super::super::q8::{self, Q8Kernel, BLOCK};
    use super::super::x86;
    use super::*;

    fn check(bits: u32, group: usize, steps: usize, st: FloatType, seed: u64) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        // Whole groups of 64-column steps: the AVX2 4-bit kernel's last four-step chunk may be short.
        let cols = (64 * steps).next_multiple_of(group);
        let gpr = cols / group;
        let codes: Vec<u32> = (0..cols).map(|_| rng.gen_range(0..(1u32 << bits))).collect();
        let packed = pack(bits, &codes);
        // Scales and biases as stored (type `st`), and their exact f32 values for the oracle.
        let s_raw = encode(st, &(0..gpr).map(|_| rng.gen_range(-0.1f32..0.1)).collect::<Vec<_>>());
        let b_raw = encode(st, &(0..gpr).map(|_| rng.gen_range(-1f32..1.0)).collect::<Vec<_>>());
        let mut scales = vec![0f32; gpr];
        let mut biases = vec![0f32; gpr];
        st.to_f32(&s_raw, 0, &mut scales);
        st.to_f32(&b_raw, 0, &mut biases);
        let x: Vec<f32> = (0..cols)
            .map(|_| rng.gen_range(-3f32..3.0) * rng.gen_range(0f32..1.0))
            .collect();
        let xsum: Vec<f32> = x.chunks(group).map(|c| c.iter().sum()).collect();
        let mut xq = vec![0i8; cols];
        let d: Vec<f32> = (x.chunks(BLOCK).zip(xq.chunks_mut(BLOCK)))
            .map(|(xb, qb)| q8::quantize_block(xb, qb))
            .collect();
        let want = q8::reference_row(&codes, &xq, &d, &scales, &biases, &xsum, group);
        let mag: f32 = (codes.iter().zip(&xq).enumerate())
            .map(|(i, (&c, &q))| (scales[i / group] * d[i / BLOCK] * c as f32 * q as f32).abs())
            .sum();
        // The quantized dot approximates the float one within the activation rounding.
        let exact: f32 = (0..cols)
            .map(|i| (scales[i / group] * codes[i] as f32 + biases[i / group]) * x[i])
            .sum();
        let wmag: f32 = (0..cols)
            .map(|i| ((scales[i / group] * codes[i] as f32) * x[i]).abs())
            .sum();
        assert!((want - exact).abs() <= 0.01 * wmag + 1e-4, "{want} vs float {exact}");
        let q = QuantMatrix {
            packed: &packed,
            scales: &[],
            biases: &[],
            scale_type: FloatType::F32,
            bits,
            group,
            rows: 1,
            cols,
        };
        let mut ran = 0;
        for isa in Isa::available() {
            let Some(k) = Q8Kernel::for_matrix(&q, isa) else {
                continue;
            };
            ran += 1;
            let acts = q8::quantize(&x, 1, cols, k);
            let args = x86::Q8RowsArgs {
                packed: &packed,
                row_bytes: packed.len(),
                rows: 1,
                tokens: 1,
                cols,
                xq: &acts.xq,
                lane_d: &acts.lane_d,
                xsum: &xsum,
                group,
            };
            let raw = x86::RawScales {
                scales: &s_raw,
                biases: &b_raw,
                ty: st,
                size: st.size(),
            };
            let mut out = [0f32];
            x86::q8_rows(k, &args, &raw, &mut out, 1);
            let got = out[0];
            assert!(
                (got - want).abs() <= 1e-5 * mag + 1e-5,
                "{k:?} group {group}: {got} vs {want}"
            );
        }
        if Isa::available().contains(&Isa::Avx2) {
            assert!(ran >= 1, "no int8 kernel ran");
        }
    }

    /// A group of 96 columns straddles the row-major kernels' steps, and a row must hold whole groups: other
    /// matrices run the exact kernels.
    #[test]
    fn groups_that_do_not_divide_128_or_the_row_get_no_row_major_int8_kernel() {
        let packed = vec![0u8; 16 * 384 / 2];
        let matrix = |group, cols| QuantMatrix {
            packed: &packed,
            scales: &[],
            biases: &[],
            scale_type: FloatType::F32,
            bits: 4,
            group,
            rows: 16,
            cols,
        };
        for (group, want) in [(96, false), (32, true), (64, true), (128, true)] {
            let q = matrix(group, 384);
            // Nor are they tiled (the tiled kernels are checked on MLX's sizes only).
            assert_eq!(super::tiled::tiles(4, group, 384), want, "tiles, group {group}");
            for isa in Isa::available() {
                let has = Q8Kernel::for_matrix(&q, isa).is_some();
                if matches!(isa, Isa::Avx2 | Isa::Avx512) {
                    assert_eq!(has, want, "{isa:?} group {group}");
                } else {
                    assert!(!has, "{isa:?} group {group}");
                }
            }
        }
        // Rows must hold whole groups: 192 columns in groups of 128 run the exact kernels.
        let q = matrix(128, 192);
        assert!(Isa::available()
            .into_iter()
            .all(|isa| Q8Kernel::for_matrix(&q, isa).is_none()));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]
        #[test]
        fn int8_kernels_match_their_oracle(
            bits in prop::sample::select(vec![4u32, 8]),
            group in prop::sample::select(vec![32usize, 64, 128]),
            steps in 1usize..10,
            st in prop::sample::select(vec![FloatType::F32, FloatType::F16, FloatType::BF16]),
            seed in any::<u64>(),
        ) {
            check(bits, group, steps, st, seed);
        }
    }

    /// A row-major 4-bit matrix read in 16-row bands gives the tiled kernel's bits on the same matrix tiled,
    /// for every token count (four per pass, then one), group size, scale type and width (whole 128-column
    /// steps or a shorter last one).
    fn band_equals_tiled(bands: usize, groups: usize, group: usize, n: usize, st: FloatType, seed: u64) {
        band_equals_tiled_on(&RandomQ4::new(16 * bands, group * groups, group, n, st, seed), n);
    }

    /// [`band_equals_tiled`] on one matrix and its `n` tokens.
    fn band_equals_tiled_on(m: &RandomQ4, n: usize) {
        let (rows, cols, group, st) = (m.rows, m.cols, m.group, m.st);
        let band = Q8Kernel::for_matrix(&m.q(), Isa::Avx512).expect("a 4-bit kernel");
        assert!(band.band, "whole bands take the band kernel");
        let (ba, ta) = (
            q8::quantize(&m.x, n, cols, band),
            q8::quantize(&m.x, n, cols, Q8Kernel::for_tiled(Isa::Avx512).unwrap()),
        );
        assert_eq!(ba.lane_d, ta.lane_d, "one scale per block in both");
        let (mut got, mut want) = (vec![0f32; rows * n], vec![0f32; rows * n]);
        for (t, tokens) in token_passes(n) {
            let [xs, ds, gs] = m.token_ranges(t, tokens);
            let args = x86::BandArgs {
                packed: &m.packed,
                scales: &m.scales,
                biases: &m.biases,
                ty: st,
                group,
                rows,
                cols,
                tokens,
                xq: &ba.xq[xs],
                block_d: &ba.lane_d[ds],
                xsum: &m.xsum[gs],
            };
            x86::q4_band_rows(&args, &mut got[t..], n);
        }
        // In panels of one tile and of four.
        for panel in [1, tiled::PASS_TILES] {
            let tiles = tiled::tile(&m.q(), panel).expect("tiles");
            want.fill(f32::NAN);
            for (t, tokens) in token_passes(n) {
                let args = m.tiled_args(&tiles, panel, &ta, (t, tokens), true);
                x86::q4_tiled_rows(&args, &mut want[t..], n);
            }
            assert_same_bits(&got, &want, n);
        }
    }

    /// A random 4-bit matrix with scales and biases of one type, and `n` tokens of activations.
    struct RandomQ4 {
        packed: Vec<u8>,
        scales: Vec<u8>,
        biases: Vec<u8>,
        st: FloatType,
        group: usize,
        rows: usize,
        cols: usize,
        x: Vec<f32>,
        xsum: Vec<f32>,
    }

    impl RandomQ4 {
        fn new(rows: usize, cols: usize, group: usize, n: usize, st: FloatType, seed: u64) -> Self {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let gpr = cols / group;
            let codes: Vec<u32> = (0..rows * cols).map(|_| rng.gen_range(0..16)).collect();
            let s: Vec<f32> = (0..rows * gpr).map(|_| rng.gen_range(-0.1f32..0.1)).collect();
            let b: Vec<f32> = (0..rows * gpr).map(|_| rng.gen_range(-1f32..1.0)).collect();
            let x: Vec<f32> = (0..n * cols)
                .map(|_| rng.gen_range(-3f32..3.0) * rng.gen_range(0f32..1.0))
                .collect();
            Self {
                packed: pack(4, &codes),
                scales: encode(st, &s),
                biases: encode(st, &b),
                st,
                group,
                rows,
                cols,
                xsum: group_sums(&x, group),
                x,
            }
        }

        /// Where tokens `t..t + tokens` lie in the activations, their block scales and their group sums.
        fn token_ranges(&self, t: usize, tokens: usize) -> [std::ops::Range<usize>; 3] {
            let (cols, blocks, groups) = (self.cols, self.cols / BLOCK, self.cols / self.group);
            [
                t * cols..(t + tokens) * cols,
                t * blocks..(t + tokens) * blocks,
                t * groups..(t + tokens) * groups,
            ]
        }

        /// The tiled kernel's arguments for tokens `t..t + tokens` of this matrix tiled as `tiles`, its
        /// activations quantized as `acts`.
        fn tiled_args<'a>(
            &'a self,
            tiles: &'a [u8],
            panel: usize,
            acts: &'a q8::QuantActs,
            (t, tokens): (usize, usize),
            avx512: bool,
        ) -> x86::TiledArgs<'a> {
            let [xs, ds, gs] = self.token_ranges(t, tokens);
            x86::TiledArgs {
                avx512,
                data: tiles,
                ty: self.st,
                group: self.group,
                rows: self.rows,
                cols: self.cols,
                panel,
                tokens,
                xq: &acts.xq[xs],
                block_d: &acts.lane_d[ds],
                xsum: &self.xsum[gs],
            }
        }

        fn q(&self) -> QuantMatrix<'_> {
            QuantMatrix {
                packed: &self.packed,
                scales: &self.scales,
                biases: &self.biases,
                scale_type: self.st,
                bits: 4,
                group: self.group,
                rows: self.rows,
                cols: self.cols,
            }
        }
    }

    /// `(first token, tokens)` of each kernel pass over `n` tokens: four while four remain, then one.
    fn token_passes(n: usize) -> impl Iterator<Item = (usize, usize)> {
        let mut t = 0;
        std::iter::from_fn(move || {
            let tokens = match n - t {
                0 => return None,
                1..4 => 1,
                _ => 4,
            };
            t += tokens;
            Some((t - tokens, tokens))
        })
    }

    /// `got` and `want` (`[rows, n]`) hold the same bits.
    fn assert_same_bits(got: &[f32], want: &[f32], n: usize) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "row {} token {}: {g} vs {w}", i / n, i % n);
        }
    }

    /// The band kernel sums lanes as i16 on the way: at the largest codes (15) and activations (±127 after
    /// quantizing), of one sign and alternating, its sums stay exact (the tiled kernel's bits).
    #[test]
    fn band_sums_stay_exact_at_their_largest() {
        if !q8::vnni_available() {
            return;
        }
        // Column `i`'s sign: all one way, or alternating in runs of 8 (one lane's columns), so neighbouring
        // lanes cancel and each alone is largest.
        let signs: [fn(usize) -> f32; 3] = [|_| 1.0, |_| -1.0, |i| [1.0, -1.0][(i / 8) % 2]];
        for (group, st) in [(32, FloatType::F32), (64, FloatType::BF16), (128, FloatType::F16)] {
            for sign in signs {
                let n = 5;
                let mut m = RandomQ4::new(32, 512, group, n, st, 7);
                m.packed.fill(0xff);
                for (i, v) in m.x.iter_mut().enumerate() {
                    *v = 2.5 * sign(i % m.cols);
                }
                m.xsum = group_sums(&m.x, group);
                band_equals_tiled_on(&m, n);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]
        #[test]
        fn row_major_bands_give_the_tiled_kernels_bits(
            bands in 1usize..6,
            groups in 1usize..9,
            group in prop::sample::select(vec![32usize, 64, 128]),
            n in 1usize..10,
            st in prop::sample::select(vec![FloatType::F32, FloatType::F16, FloatType::BF16]),
            seed in any::<u64>(),
        ) {
            if q8::vnni_available() {
                band_equals_tiled(bands, groups, group, n, st, seed);
            }
        }

        #[test]
        fn avx2_row_major_rows_give_the_avx2_tiled_kernels_bits(
            rows in 1usize..150,
            steps in 1usize..20,
            group in prop::sample::select(vec![32usize, 64, 128]),
            n in 1usize..10,
            st in prop::sample::select(vec![FloatType::F32, FloatType::F16, FloatType::BF16]),
            seed in any::<u64>(),
        ) {
            if Isa::available().contains(&Isa::Avx2) {
                avx2_row_major_equals_tiled(rows, steps, group, n, st, seed);
            }
        }
    }

    /// The AVX2 row-major 4-bit kernel and the AVX2 tiled kernel give the same bits on one matrix, stored and
    /// tiled, for every token count (four per pass, then one; or three, two and one), group size, scale type, partial last tile and
    /// width (rows whose last 256-column chunk and last batch of eight groups are short). A stored expert record
    /// then computes what its tiled copy computes, so streamed decode equals resident decode on AVX2.
    fn avx2_row_major_equals_tiled(rows: usize, steps: usize, group: usize, n: usize, st: FloatType, seed: u64) {
        let m = RandomQ4::new(rows, (64 * steps).next_multiple_of(group), group, n, st, seed);
        let cols = m.cols;
        let row_major = Q8Kernel::for_matrix(&m.q(), Isa::Avx2).expect("the AVX2 4-bit kernel");
        let tiled_k = Q8Kernel::for_tiled(Isa::Avx2).expect("the AVX2 tiled kernel");
        assert!(!row_major.avx512 && !row_major.band && !tiled_k.avx512 && tiled_k.tiled);
        let (ra, ta) = (
            q8::quantize(&m.x, n, cols, row_major),
            q8::quantize(&m.x, n, cols, tiled_k),
        );
        let raw = x86::RawScales {
            scales: &m.scales,
            biases: &m.biases,
            ty: st,
            size: st.size(),
        };
        let (mut got, mut want) = (vec![0f32; rows * n], vec![0f32; rows * n]);
        for (t, tokens) in token_passes(n) {
            let [xs, ds, gs] = m.token_ranges(t, tokens);
            let args = x86::Q8RowsArgs {
                packed: &m.packed,
                row_bytes: cols / 2,
                rows,
                tokens,
                cols,
                xq: &ra.xq[xs],
                lane_d: &ra.lane_d[ds],
                xsum: &m.xsum[gs],
                group,
            };
            x86::q8_rows(row_major, &args, &raw, &mut want[t..], n);
        }
        // In panels of one tile and of four.
        for panel in [1, tiled::PASS_TILES] {
            let tiles = tiled::tile(&m.q(), panel).expect("tiles");
            got.fill(f32::NAN);
            for (t, tokens) in token_passes(n) {
                let args = m.tiled_args(&tiles, panel, &ta, (t, tokens), false);
                x86::q4_tiled_rows(&args, &mut got[t..], n);
            }
            assert_same_bits(&got, &want, n);
            // Passes of three tokens (and a last one of one or two) give the same.
            let mut again = vec![f32::NAN; rows * n];
            for t in (0..n).step_by(3) {
                let args = m.tiled_args(&tiles, panel, &ta, (t, 3.min(n - t)), false);
                x86::q4_tiled_rows(&args, &mut again[t..], n);
            }
            assert_same_bits(&again, &want, n);
        }
    }

    /// Rows longer than the property test's (1,056 to 4,096 columns: 8 to 32 128-column steps, some with a
    /// shorter last step) still give the tiled kernel's bits, for one token and for several.
    #[test]
    fn long_rows_give_the_tiled_kernels_bits() {
        if !q8::vnni_available() {
            return;
        }
        for st in [FloatType::F32, FloatType::F16, FloatType::BF16] {
            for (groups, group, n) in [(37, 64, 1), (37, 64, 5), (64, 64, 1), (17, 128, 2), (33, 32, 1)] {
                band_equals_tiled(2, groups, group, n, st, groups as u64 * 31 + n as u64);
            }
        }
    }

    #[test]
    fn zero_and_extreme_activations() {
        let mut q = [0i8; BLOCK];
        assert_eq!(q8::quantize_block(&[0.0; BLOCK], &mut q), 0.0);
        assert!(q.iter().all(|&v| v == 0));
        let mut x = [0.5f32; BLOCK];
        x[3] = -100.0;
        let d = q8::quantize_block(&x, &mut q);
        assert_eq!(q[3], -127);
        assert!((d * 127.0 - 100.0).abs() < 1e-4);
    }
}

#[test]
fn exp_is_within_one_ulp_of_f64_over_its_range() {
    // Every 97th float bit pattern from EXP_LO to EXP_HI, both signs: about 300k values.
    let mut worst = 0f64;
    let mut check = |x: f32| {
        let want = (x as f64).exp();
        let got = scalar::exp(x) as f64;
        // One ulp of the f32 nearest the true value (normal range).
        let ulp = f32::EPSILON as f64 * 2f64.powi((want.log2().floor()) as i32);
        worst = worst.max((got - want).abs() / ulp);
    };
    for bits in (0..scalar::EXP_HI.to_bits()).step_by(97) {
        check(f32::from_bits(bits));
    }
    for bits in (0x8000_0000..(-80f32).to_bits()).step_by(97) {
        check(f32::from_bits(bits));
    }
    assert!(worst <= 1.0, "worst error {worst} ulp");
}

#[test]
fn exp_edges() {
    assert_eq!(scalar::exp(0.0), 1.0);
    assert_eq!(scalar::exp(-100.0), 0.0);
    assert_eq!(scalar::exp(f32::NEG_INFINITY), 0.0);
    assert!(scalar::exp(f32::NAN).is_nan());
    assert!(scalar::exp(1000.0).is_finite() && scalar::exp(1000.0) > 1e38);
    for isa in Isa::available() {
        let mut x = vec![0.0, -200.0, 1.0, f32::NEG_INFINITY, 1.0];
        x.extend([-1e30; 20]);
        isa.softmax(&mut x);
        let e = 1.0 / (2.0 + 1.0 / std::f32::consts::E);
        assert!(
            (x[2] - e).abs() < 1e-7 && x[2] == x[4] && x[1] == 0.0 && x[3] == 0.0,
            "{isa:?}: {x:?}"
        );
        let mut x = vec![1.0; 37];
        x[30] = f32::NAN;
        isa.softmax(&mut x);
        assert!(x.iter().all(|v| v.is_nan()), "{isa:?}: NaN must not be hidden");
        let mut empty: Vec<f32> = vec![];
        isa.softmax(&mut empty);
        // silu: NaN stays NaN, −∞ gives NaN (−∞/∞), very negative gates −0, +∞ stays +∞.
        let mut g = vec![f32::NAN, f32::NEG_INFINITY, -200.0, f32::INFINITY, 0.0, 1.0];
        g.extend([-1e30; 11]);
        isa.swiglu(&mut g, &[1.0; 17]);
        assert!(
            g[0].is_nan() && g[1].is_nan() && g[2] == 0.0 && g[3] == f32::INFINITY && g[4] == 0.0,
            "{isa:?}: {g:?}"
        );
        assert!(
            (g[5] - 1.0 / (1.0 + 1.0 / std::f32::consts::E)).abs() < 1e-7,
            "{isa:?}: {g:?}"
        );
        assert!(g[6..].iter().all(|v| *v == 0.0), "{isa:?}: {g:?}");
        // Special and boundary gates times special ups: the scalar bits (any NaN for a NaN), sign of zero included.
        let gates = [
            f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            88.37,
            -88.37,
            -88.38,
            -88.5,
            -88.8,
            -87.4,
            -103.9,
            -104.5,
            103.9,
            1e30,
            -1e30,
        ];
        let (g, u): (Vec<f32>, Vec<f32>) = gates
            .iter()
            .flat_map(|&g| [1.0, -2.0, 0.0, -0.0, f32::INFINITY, f32::NAN].map(|u| (g, u)))
            .unzip();
        let (mut want, mut got) = (g.clone(), g.clone());
        scalar::swiglu(&mut want, &u);
        isa.swiglu(&mut got, &u);
        for (i, (w, v)) in want.iter().zip(&got).enumerate() {
            assert!(
                w.to_bits() == v.to_bits() || (w.is_nan() && v.is_nan()),
                "{isa:?}: {} × {}: {w} vs {v}",
                g[i],
                u[i]
            );
        }
        // A shorter `up` leaves the rest of `gate` as it was.
        let mut g: Vec<f32> = (0..13).map(|i| i as f32 - 6.0).collect();
        isa.swiglu(&mut g, &[1.0; 9]);
        assert_eq!(&g[9..], &[3.0, 4.0, 5.0, 6.0], "{isa:?}");
    }
}

/// Both DRAM probe patterns sum every whole 64-bit word of a chunk exactly once, whatever its length.
#[test]
fn dram_probe_patterns_read_the_same_words() {
    for len in [0usize, 7, 8, 31, 33, 40, 1000, (1 << 19) + 24] {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
        let want = (bytes.chunks_exact(8)).fold(0u64, |s, w| {
            s.wrapping_add(u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
        });
        assert_eq!(sum_words(&bytes), want, "{len} bytes");
        assert_eq!(sum_four_streams(&bytes), want, "{len} bytes");
    }
    let p = dram_read_probe(1 << 20, std::time::Duration::ZERO);
    assert!(p.one_stream > 0.0 && p.four_streams > 0.0 && p.best() == p.one_stream.max(p.four_streams));
}

#[cfg(target_arch = "x86_64")]
#[test]
fn cpu_families_read_from_cpuid_signatures() {
    // Real leaf-1 EAX values: Zen 4 (EPYC 9004), Zen 5 (EPYC 9005), and an Intel core (base family 6).
    assert_eq!(x86::family_of(0x00A1_0F11), 25);
    assert_eq!(x86::family_of(0x00B0_0F21), 26);
    assert_eq!(x86::family_of(0x0008_06F8), 6);
    // What decode prefetch defaults to for each: on for Intel and Zen 5, off for Zen 4 and other vendors.
    assert!(prefetch_by_default(true, None));
    assert!(prefetch_by_default(false, Some(x86::family_of(0x00B0_0F21))));
    assert!(!prefetch_by_default(false, Some(x86::family_of(0x00A1_0F11))));
    assert!(!prefetch_by_default(false, None));
}

#[test]
fn decode_prefetch_follows_the_vendor_unless_overridden() {
    assert!(decode_prefetch_rule(true, None));
    assert!(!decode_prefetch_rule(false, None));
    assert!(decode_prefetch_rule(false, Some("1")));
    assert!(!decode_prefetch_rule(true, Some(" 0 ")));
    assert!(
        decode_prefetch_rule(true, Some("maybe")),
        "an unreadable value keeps the vendor's default"
    );
    assert!(!decode_prefetch_rule(false, Some("maybe")));
}

#[test]
fn tile_panels_follow_the_vendor_unless_overridden() {
    assert_eq!(panel_tiles_rule(true, None), 1);
    assert_eq!(panel_tiles_rule(false, None), 4);
    assert_eq!(panel_tiles_rule(true, Some(" 4 ")), 4);
    assert_eq!(panel_tiles_rule(false, Some("1")), 1);
    for bad in ["2", "0", "wide"] {
        assert_eq!(panel_tiles_rule(true, Some(bad)), 1, "{bad} keeps the vendor's default");
        assert_eq!(
            panel_tiles_rule(false, Some(bad)),
            4,
            "{bad} keeps the vendor's default"
        );
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[test]
fn the_vendor_check_reads_cpuid_as_proc_cpuinfo_does() {
    // Test-only: the kernels never read /proc; here it is the independent oracle for the cpuid decoding.
    let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
    let vendor = info
        .lines()
        .find_map(|l| l.strip_prefix("vendor_id"))
        .expect("a vendor_id line");
    let vendor = vendor.trim_start_matches([' ', '\t', ':']).trim();
    assert_eq!(x86::intel_cpu(), vendor == "GenuineIntel", "vendor_id {vendor}");
}
