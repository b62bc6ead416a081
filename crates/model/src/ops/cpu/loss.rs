//! The loss's `sigmoid_cross_entropy_with_logits` and its gradient, with `exp` and `ln(1 + e)`
//! written to vectorise.

use rayon::prelude::*;

/// Rows (anchors) per task of the sigmoid cross-entropy loops.
const ROWS_PER_TASK: usize = 512;

/// `n` values computed in parallel, `chunk` at a time, into a new vector without zeroing it
/// first: `values(range)` yields the values at `range`.
fn parallel_values<I: ExactSizeIterator<Item = f32>>(
    n: usize,
    chunk: usize,
    values: impl Fn(std::ops::Range<usize>) -> I + Sync,
) -> Vec<f32> {
    let chunk = chunk.max(1);
    let mut out: Vec<f32> = Vec::with_capacity(n);
    out.spare_capacity_mut()[..n]
        .par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(i, out)| {
            let start = i * chunk;
            let values = values(start..start + out.len());
            assert_eq!(values.len(), out.len(), "one value for each place");
            for (o, v) in out.iter_mut().zip(values) {
                o.write(v);
            }
        });
    // SAFETY: the chunks cover all `n` places, and each chunk's were written above (the
    // assertion guarantees as many values as places).
    unsafe { out.set_len(n) };
    out
}

/// `exp(y)` for `y <= 0` (below -87.3 it returns `exp(-87.3)`, about 1.2e-38), without a
/// library call, so that loops over it vectorise: `y = n ln 2 + r` with `|r| <= ln 2 / 2`
/// (Cody-Waite split of `ln 2`), `exp(r)` by its Taylor series to `r^7` (truncation below
/// 3e-9 relative), times `2^n` built in the exponent bits.
fn exp_non_positive(y: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let y = y.clamp(-87.3, 0.0);
    let n = (y * std::f32::consts::LOG2_E).round_ties_even();
    let r = (y - n * LN2_HI) - n * LN2_LO;
    let taylor = [
        1.0 / 5040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
    polynomial(r, taylor) * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `ln(1 + e)` for `e` in `[0, 1]` without a library call: `2 atanh(s)` with
/// `s = e / (2 + e) <= 1/3`, its odd series to `s^15` (truncation below 1e-9 relative; no
/// loss for tiny `e`, where `1 + e` would round to 1).
fn ln_1p_unit(e: f32) -> f32 {
    let s = e / (2.0 + e);
    let odd = [
        1.0 / 15.0,
        1.0 / 13.0,
        1.0 / 11.0,
        1.0 / 9.0,
        1.0 / 7.0,
        1.0 / 5.0,
        1.0 / 3.0,
        1.0,
    ];
    2.0 * s * polynomial(s * s, odd)
}

/// `c[0] x^(N-1) + c[1] x^(N-2) + ... + c[N-1]` by Horner's rule (fused multiply-adds).
fn polynomial<const N: usize>(x: f32, coefficients: [f32; N]) -> f32 {
    coefficients[1..]
        .iter()
        .fold(coefficients[0], |p, &c| p.mul_add(x, c))
}

/// `sigmoid_cross_entropy_with_logits` of one logit `x` and label `z`:
/// `max(x, 0) - x z + log(1 + exp(-|x|))`.
fn sigmoid_cross_entropy_value(x: f32, z: f32) -> f32 {
    x.max(0.0) - x * z + ln_1p_unit(exp_non_positive(-x.abs()))
}

/// `sigmoid_cross_entropy_with_logits` of `[rows, classes]` logits and labels, summed over
/// each row's classes: `max(x, 0) - x z + log(1 + exp(-|x|))`. The values are computed
/// over a task's rows in one vectorised pass, then summed row by row.
pub fn sigmoid_cross_entropy(logits: &[f32], labels: &[f32], classes: usize) -> Vec<f32> {
    assert_eq!(logits.len(), labels.len());
    let classes = classes.max(1);
    parallel_values(logits.len() / classes, ROWS_PER_TASK, |rows| {
        let values = rows.start * classes..rows.end * classes;
        let (x, z) = (&logits[values.clone()], &labels[values]);
        let terms: Vec<f32> = x
            .iter()
            .zip(z)
            .map(|(&x, &z)| sigmoid_cross_entropy_value(x, z))
            .collect();
        (0..rows.len()).map(move |r| terms[r * classes..][..classes].iter().sum())
    })
}

/// `sigmoid(x)` without overflow for large `|x|` and without branches:
/// `1 / (1 + exp(-x))` for `x >= 0`, `exp(x) / (1 + exp(x))` below.
fn sigmoid(x: f32) -> f32 {
    let e = exp_non_positive(-x.abs());
    let s = 1.0 / (1.0 + e);
    if x >= 0.0 { s } else { e * s }
}

/// Gradient of [`sigmoid_cross_entropy`] for the per-row output gradient `grad`:
/// `(sigmoid(x) - z) * grad[row]`.
pub fn sigmoid_cross_entropy_backward(
    logits: &[f32],
    labels: &[f32],
    grad: &[f32],
    classes: usize,
) -> Vec<f32> {
    assert_eq!(logits.len(), labels.len());
    let classes = classes.max(1);
    assert_eq!(grad.len() * classes, logits.len());
    let mut out = vec![0.0f32; logits.len()];
    out.par_chunks_mut(ROWS_PER_TASK * classes)
        .zip(logits.par_chunks(ROWS_PER_TASK * classes))
        .zip(labels.par_chunks(ROWS_PER_TASK * classes))
        .zip(grad.par_chunks(ROWS_PER_TASK))
        .for_each(|(((out, x), z), g)| {
            let rows = out.chunks_mut(classes).zip(x.chunks(classes));
            for ((o, x), (z, &g)) in rows.zip(z.chunks(classes).zip(g)) {
                for ((o, &x), &z) in o.iter_mut().zip(x).zip(z) {
                    *o = (sigmoid(x) - z) * g;
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Relative error of `got` against the exact `want` (absolute below 1e-30).
    fn relative_error(got: f32, want: f64) -> f64 {
        (got as f64 - want).abs() / want.abs().max(1e-30)
    }

    #[test]
    fn exp_and_ln_1p_match_the_exact_functions_to_float_precision() {
        // every 1/1000 from -87 to 0: within 2 float ulps (2^-23 relative each) of exp
        let mut worst_exp = 0.0f64;
        for i in 0..=87_000 {
            let y = -(i as f32) / 1000.0;
            worst_exp = worst_exp.max(relative_error(exp_non_positive(y), (y as f64).exp()));
        }
        assert!(
            worst_exp < 2.5e-7,
            "exp: worst relative error {worst_exp:e}"
        );
        assert_eq!(exp_non_positive(0.0), 1.0);
        // the clamp: far below -87.3, the value at -87.3 (tiny, positive, finite)
        let floor = exp_non_positive(-1000.0);
        assert!(floor > 0.0 && floor < 1.3e-38, "{floor:e}");

        // ln(1 + e) on [0, 1], down to e = 1e-30 where 1 + e rounds to 1
        let mut worst_ln = 0.0f64;
        for i in 0..=10_000 {
            let e = i as f32 / 10_000.0;
            let want = (e as f64).ln_1p();
            if e > 0.0 {
                worst_ln = worst_ln.max(relative_error(ln_1p_unit(e), want));
            }
        }
        for e in [1e-30f32, 1e-12, 1e-8, 3e-5] {
            worst_ln = worst_ln.max(relative_error(ln_1p_unit(e), (e as f64).ln_1p()));
        }
        assert!(
            worst_ln < 2.5e-7,
            "ln_1p: worst relative error {worst_ln:e}"
        );
        assert_eq!(ln_1p_unit(0.0), 0.0);
    }

    #[test]
    fn sigmoid_and_the_loss_term_match_their_definitions() {
        for i in -4000..=4000 {
            let x = i as f32 / 50.0;
            let exact = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!(relative_error(sigmoid(x), exact) < 5e-7, "sigmoid({x})");
            for z in [0.0f32, 0.3, 1.0] {
                let (xd, zd) = (x as f64, z as f64);
                let want = xd.max(0.0) - xd * zd + (-xd.abs()).exp().ln_1p();
                let got = sigmoid_cross_entropy_value(x, z) as f64;
                // absolute against the larger of the terms (the subtraction cancels)
                let scale = xd.abs().max(1.0);
                assert!(
                    (got - want).abs() < 5e-7 * scale,
                    "loss({x}, {z}): {got} vs {want}"
                );
            }
        }
    }
}
