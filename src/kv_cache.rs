//! spec-run's `--kv_cache_*` flags, TensorRT-LLM's spelling: `--kv_cache_enable_block_reuse`
//! and `--kv_cache_free_gpu_memory_fraction F`.

use kestrel_runtime::kv_budget::FRACTION_FLAG;
use kestrel_runtime::KvCacheOptions;

/// The options for the runtime; `fraction` is the flag's text as given. Errors quote it.
pub fn kv_cache_options(
    enable_block_reuse: bool,
    fraction: Option<&str>,
) -> Result<KvCacheOptions, String> {
    let free_memory_fraction = match fraction {
        None => None,
        Some(text) => {
            let f: f64 = text.trim().parse().map_err(|_| {
                format!("{FRACTION_FLAG} '{text}' is not a number: give a fraction in (0, 1], for example 0.9")
            })?;
            if !(f > 0.0 && f <= 1.0) {
                return Err(format!(
                    "{FRACTION_FLAG} {text} must be in (0, 1]: it is the share of free device memory the KV cache may take"
                ));
            }
            Some(f)
        }
    };
    Ok(KvCacheOptions {
        enable_block_reuse,
        free_memory_fraction,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_in_the_half_open_unit_interval_only() {
        let ok = |t: &str| {
            kv_cache_options(false, Some(t))
                .unwrap()
                .free_memory_fraction
        };
        assert_eq!(ok("0.9"), Some(0.9));
        assert_eq!(ok("1"), Some(1.0));
        assert_eq!(ok("1e-3"), Some(0.001));
        assert_eq!(
            kv_cache_options(true, None).unwrap(),
            KvCacheOptions {
                enable_block_reuse: true,
                free_memory_fraction: None
            }
        );
        for bad in ["0", "-0.1", "1.5", "NaN", "inf"] {
            let err = kv_cache_options(false, Some(bad)).unwrap_err();
            assert_eq!(
                err,
                format!("{FRACTION_FLAG} {bad} must be in (0, 1]: it is the share of free device memory the KV cache may take")
            );
        }
        assert_eq!(
            kv_cache_options(false, Some("abc")).unwrap_err(),
            format!(
                "{FRACTION_FLAG} 'abc' is not a number: give a fraction in (0, 1], for example 0.9"
            )
        );
    }
}
