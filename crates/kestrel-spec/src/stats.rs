//! Test helpers: chi-square goodness of fit at p = 0.001.

/// Counts `n` draws of `draw` into `bins` bins.
pub fn counts(bins: usize, n: usize, mut draw: impl FnMut() -> usize) -> Vec<u64> {
    let mut c = vec![0u64; bins];
    for _ in 0..n {
        c[draw()] += 1;
    }
    c
}

/// Upper 0.001 quantile of chi-square with `df` degrees of freedom (Wilson–Hilferty).
pub fn chi2_critical_p001(df: usize) -> f64 {
    const Z: f64 = 3.090_232_306; // standard normal 0.999 quantile
    let k = df as f64;
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + Z * a.sqrt()).powi(3)
}

/// Pearson's statistic and degrees of freedom. `expected` are probabilities (scaled by the
/// total count). Bins with expected count < 5 are pooled. A bin with zero expected
/// probability and a non-zero count is an immediate failure (infinite statistic).
pub fn chi2(counts: &[u64], expected: &[f64]) -> (f64, usize) {
    assert_eq!(counts.len(), expected.len());
    let n: u64 = counts.iter().sum();
    let total_p: f64 = expected.iter().sum();
    let mut stat = 0.0;
    let mut bins = 0usize;
    let (mut pool_obs, mut pool_exp) = (0.0f64, 0.0f64);
    for (&c, &p) in counts.iter().zip(expected) {
        let e = p / total_p * n as f64;
        if p == 0.0 {
            if c > 0 {
                return (f64::INFINITY, 1);
            }
            continue;
        }
        if e < 5.0 {
            pool_obs += c as f64;
            pool_exp += e;
            continue;
        }
        stat += (c as f64 - e).powi(2) / e;
        bins += 1;
    }
    if pool_exp > 0.0 {
        stat += (pool_obs - pool_exp).powi(2) / pool_exp.max(1e-12);
        bins += 1;
    }
    (stat, bins.saturating_sub(1).max(1))
}

/// Asserts the counts fit the expected distribution at p = 0.001.
pub fn assert_fits(counts: &[u64], expected: &[f64], what: &str) {
    let (stat, df) = chi2(counts, expected);
    let crit = chi2_critical_p001(df);
    assert!(
        stat < crit,
        "{what}: chi-square {stat:.2} >= critical {crit:.2} (df {df}); counts {counts:?}, expected {expected:?}"
    );
}

#[test]
fn wilson_hilferty_close_to_table() {
    // Table values of the 0.999 quantile.
    for (df, want) in [
        (1, 10.828),
        (7, 24.322),
        (10, 29.588),
        (30, 59.703),
        (63, 103.442),
    ] {
        let got = chi2_critical_p001(df);
        assert!((got - want).abs() / want < 0.05, "df {df}: {got} vs {want}");
    }
}
