//! Statistics for benchmark rows: mean, sample standard deviation, and a paired ratio with a
//! Student-t confidence interval (runs are interleaved, so repetition i of mlxb and of the
//! baseline saw the same machine state; pairing cancels much of the noise).

/// Arithmetic mean (0 for no samples).
pub fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        return 0.0;
    }
    x.iter().sum::<f64>() / x.len() as f64
}

/// Sample standard deviation (n-1 denominator; 0 below two samples).
pub fn stddev(x: &[f64]) -> f64 {
    if x.len() < 2 {
        return 0.0;
    }
    let m = mean(x);
    (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() - 1) as f64).sqrt()
}

/// Two-sided 95% Student-t quantile for `dof` degrees of freedom.
pub fn t95(dof: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match dof {
        0 => f64::INFINITY,
        d if d <= 30 => TABLE[d - 1],
        _ => 1.960,
    }
}

/// Mean of the paired ratios `a[i] / b[i]` with its 95% confidence interval.
pub fn paired_ratio(a: &[f64], b: &[f64]) -> (f64, f64, f64) {
    let r: Vec<f64> = a
        .iter()
        .zip(b)
        .filter(|(_, &y)| y > 0.0)
        .map(|(x, y)| x / y)
        .collect();
    let m = mean(&r);
    let half = if r.len() < 2 {
        f64::INFINITY
    } else {
        t95(r.len() - 1) * stddev(&r) / (r.len() as f64).sqrt()
    };
    (m, m - half, m + half)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        let x = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0];
        assert_eq!(mean(&x), 5.0);
        // Sample std of this classic set is sqrt(32/7).
        assert!((stddev(&x) - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!(t95(4), 2.776);
        let (r, lo, hi) = paired_ratio(&[2.0, 4.0, 6.0], &[1.0, 2.0, 3.0]);
        assert_eq!((r, lo, hi), (2.0, 2.0, 2.0));
        let (r, lo, hi) = paired_ratio(&[1.0, 3.0], &[1.0, 1.0]);
        assert_eq!(r, 2.0);
        assert!((hi - r - 12.706 * 2f64.sqrt() / 2f64.sqrt()).abs() < 1e-9 && lo < r);
    }
}
