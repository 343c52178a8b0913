//! How many KV blocks each cache of a run gets.
//!
//! By default a cache holds every sequence of a full batch at `max_seq_len` plus one
//! verification step ([`Engine::kv_blocks`]). With `--kv_cache_free_gpu_memory_fraction F`
//! (TensorRT-LLM's `free_gpu_memory_fraction`), the caches on one device share `F` × the
//! memory that device has free once the weights are loaded — `cudaMemGetInfo` on CUDA,
//! `MemAvailable` of `/proc/meminfo` on the CPU — split in proportion to their KV bytes per
//! token, so that a target and its draft (or the EAGLE head) can hold the same number of
//! tokens. A cache never gets more than the default, and it must hold at least one sequence
//! of `max_input_len` + `max_output_len` tokens; batches are then cut to what the pools hold.

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use candle_core::{DType, Device};
use kestrel_model::PagedKvCache;

/// `--kv_cache_*` options of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvCacheOptions {
    /// Keep full prompt blocks of finished requests and attach them to later requests whose
    /// prompts start with the same tokens (`--kv_cache_enable_block_reuse`).
    pub enable_block_reuse: bool,
    /// Size the pools from this share of free device memory, in (0, 1]; `None`: the default
    /// size (`--kv_cache_free_gpu_memory_fraction`).
    pub free_memory_fraction: Option<f64>,
}

pub const FRACTION_FLAG: &str = "--kv_cache_free_gpu_memory_fraction";

impl KvCacheOptions {
    /// A cache of `pool`'s size made by `new` (a model's or head's `new_cache`), keeping the
    /// full prompt blocks of finished requests for reuse when the run asks for it.
    pub(crate) fn new_cache(
        &self,
        pool: &PoolShape,
        new: impl FnOnce(usize, usize) -> kestrel_model::Result<PagedKvCache>,
    ) -> Result<PagedKvCache> {
        let mut cache = new(pool.blocks, pool.block_size)?;
        if self.enable_block_reuse {
            cache.enable_prefix_reuse();
        }
        Ok(cache)
    }

    pub fn validate(&self) -> Result<()> {
        match self.free_memory_fraction {
            Some(f) if !(f > 0.0 && f <= 1.0) => Err(RuntimeError::InvalidRequest(format!(
                "{FRACTION_FLAG} {f} must be in (0, 1]: it is the share of free device memory the KV cache may take"
            ))),
            _ => Ok(()),
        }
    }
}

/// One cache to size.
pub(crate) struct PoolSpec<'a> {
    /// As shown in errors and profiles: `target`, `draft` or `eagle_head`.
    pub name: &'static str,
    pub device: &'a Device,
    pub bytes_per_token: u64,
    pub block_size: usize,
    /// The default size, and the most it may get.
    pub default_blocks: usize,
    /// Slots a sequence may hold beyond its committed tokens (a verification step).
    pub headroom: usize,
}

impl<'a> PoolSpec<'a> {
    /// The cache of `engine`'s model.
    pub fn for_engine(name: &'static str, engine: &'a Engine) -> Self {
        Self::for_model(
            name,
            engine,
            &engine.config,
            engine.config.num_hidden_layers,
        )
    }

    /// A cache of `layers` layers shaped by `c` (the EAGLE head's: one per head layer) that lives with
    /// `engine` and follows its limits.
    pub fn for_model(
        name: &'static str,
        engine: &'a Engine,
        c: &kestrel_core::ModelConfig,
        layers: usize,
    ) -> Self {
        let dtype = kestrel_model::candle_dtype(engine.plan.dtype);
        let l = &engine.plan.limits;
        PoolSpec {
            name,
            device: &engine.device,
            bytes_per_token: kv_bytes_per_token(layers, c.num_kv_heads(), c.head_dim(), dtype),
            block_size: l.tokens_per_block,
            default_blocks: engine.kv_blocks(),
            headroom: l.max_draft_len + 1,
        }
    }

    /// Blocks one sequence of `len` committed tokens may need.
    pub fn blocks_for(&self, len: usize) -> usize {
        (len + self.headroom).div_ceil(self.block_size)
    }
}

/// A sized pool, as a decoder reports it.
#[derive(Debug, Clone)]
pub(crate) struct PoolShape {
    pub name: &'static str,
    pub blocks: usize,
    pub block_size: usize,
    pub headroom: usize,
}

impl PoolShape {
    /// Blocks one sequence of `len` committed tokens may need.
    pub fn blocks_for(&self, len: usize) -> usize {
        (len + self.headroom).div_ceil(self.block_size)
    }
}

/// Sizes the caches of a run whose target is `target` and whose requests generate up to
/// `max_output_len` tokens.
pub(crate) fn size_pools(
    specs: &[PoolSpec],
    options: &KvCacheOptions,
    target: &Engine,
    max_output_len: usize,
) -> Result<Vec<PoolShape>> {
    let l = &target.plan.limits;
    let longest = (l.max_input_len + max_output_len).min(l.max_seq_len);
    let blocks = pool_blocks(specs, options, longest)?;
    Ok(specs
        .iter()
        .zip(blocks)
        .map(|(s, blocks)| PoolShape {
            name: s.name,
            blocks,
            block_size: s.block_size,
            headroom: s.headroom,
        })
        .collect())
}

/// K and V of every layer for one token.
pub(crate) fn kv_bytes_per_token(layers: usize, n_kv: usize, head_dim: usize, dtype: DType) -> u64 {
    (2 * layers * n_kv * head_dim * dtype.size_in_bytes()) as u64
}

/// Blocks per cache, in the order of `specs`. `longest` is the longest sequence a request
/// may reach (`max_input_len + max_output_len`, capped at `max_seq_len`).
pub(crate) fn pool_blocks(
    specs: &[PoolSpec],
    options: &KvCacheOptions,
    longest: usize,
) -> Result<Vec<usize>> {
    options.validate()?;
    let Some(fraction) = options.free_memory_fraction else {
        return Ok(specs.iter().map(|s| s.default_blocks).collect());
    };
    let mut blocks = vec![0; specs.len()];
    for (i, spec) in specs.iter().enumerate() {
        // Caches on one device share its budget; the first of them sizes them all. Devices
        // compare by location: two handles opened on one GPU still share its memory.
        let here = spec.device.location();
        if specs[..i].iter().any(|s| s.device.location() == here) {
            continue;
        }
        let group: Vec<usize> = (0..specs.len())
            .filter(|&j| specs[j].device.location() == here)
            .collect();
        let free = free_memory(spec.device)?;
        let budget = (fraction * free as f64) as u64;
        let per_token: u64 = group.iter().map(|&j| specs[j].bytes_per_token).sum();
        let tokens = (budget / per_token.max(1)) as usize;
        for &j in &group {
            let s = &specs[j];
            let got = tokens / s.block_size;
            let need = s.blocks_for(longest);
            if got < need {
                return Err(RuntimeError::InvalidRequest(format!(
                    "{FRACTION_FLAG} {fraction}: the {} KV cache gets {got} blocks of {} tokens ({fraction} × {} free on {}, shared by {} cache(s) at {per_token} bytes per token), but one sequence of max_input_len + max_output_len = {longest} tokens needs {need}: raise {FRACTION_FLAG}, lower --max_output_len or free memory",
                    s.name,
                    s.block_size,
                    human_bytes(free),
                    device_name(s.device),
                    group.len(),
                )));
            }
            blocks[j] = got.min(s.default_blocks);
        }
    }
    Ok(blocks)
}

fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "the CPU".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

fn human_bytes(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Bytes the device has free now.
fn free_memory(device: &Device) -> Result<u64> {
    if device.is_cpu() {
        return cpu_available();
    }
    cuda_free(device)
}

#[cfg(feature = "cuda")]
fn cuda_free(device: &Device) -> Result<u64> {
    let cuda = device.as_cuda_device()?;
    let (free, _total) = cuda.cuda_stream().context().mem_get_info().map_err(|e| {
        RuntimeError::Engine(format!(
            "{FRACTION_FLAG}: cannot query the free memory of {}: {e}",
            device_name(device)
        ))
    })?;
    Ok(free as u64)
}

#[cfg(not(feature = "cuda"))]
fn cuda_free(device: &Device) -> Result<u64> {
    Err(RuntimeError::Engine(format!(
        "{FRACTION_FLAG}: cannot query the free memory of {}: this build has no CUDA support",
        device_name(device)
    )))
}

/// `MemAvailable` of `/proc/meminfo`: what the kernel can hand out without swapping.
fn cpu_available() -> Result<u64> {
    const PATH: &str = "/proc/meminfo";
    let text = std::fs::read_to_string(PATH).map_err(|e| {
        RuntimeError::Engine(format!(
            "{FRACTION_FLAG}: cannot read {PATH} to size the KV cache from free memory ({e})"
        ))
    })?;
    parse_mem_available(&text).ok_or_else(|| {
        RuntimeError::Engine(format!(
            "{FRACTION_FLAG}: {PATH} has no MemAvailable line to size the KV cache from"
        ))
    })
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => Some(value * 1024),
        None => Some(value),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec<'a>(
        name: &'static str,
        device: &'a Device,
        bpt: u64,
        default_blocks: usize,
    ) -> PoolSpec<'a> {
        PoolSpec {
            name,
            device,
            bytes_per_token: bpt,
            block_size: 8,
            default_blocks,
            headroom: 1,
        }
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text = "MemTotal:       16314876 kB\nMemFree:  100 kB\nMemAvailable:   11534336 kB\n";
        assert_eq!(parse_mem_available(text), Some(11534336 * 1024));
        assert_eq!(parse_mem_available("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn default_sizes_without_a_fraction_and_bad_fractions_are_refused() {
        let cpu = Device::Cpu;
        let specs = [spec("target", &cpu, 100, 40), spec("draft", &cpu, 10, 30)];
        let opts = KvCacheOptions::default();
        assert_eq!(pool_blocks(&specs, &opts, 16).unwrap(), vec![40, 30]);
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let opts = KvCacheOptions {
                free_memory_fraction: Some(bad),
                ..Default::default()
            };
            let err = pool_blocks(&specs, &opts, 16).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("{FRACTION_FLAG} {bad} must be in (0, 1]")),
                "{err}"
            );
        }
    }

    #[test]
    fn one_device_is_split_by_bytes_per_token_and_capped_at_the_default() {
        let cpu = Device::Cpu;
        let free = cpu_available().unwrap();
        // Pools so costly per token that a tiny fraction of free memory holds few blocks.
        let bpt_target = free / 64;
        let bpt_draft = free / 192;
        let specs = [
            spec("target", &cpu, bpt_target, 1 << 40),
            spec("draft", &cpu, bpt_draft, 1 << 40),
        ];
        let opts = KvCacheOptions {
            free_memory_fraction: Some(1.0),
            ..Default::default()
        };
        let got = pool_blocks(&specs, &opts, 8).unwrap();
        // Both hold the same number of tokens: free / (bpt_t + bpt_d) ≈ 48, i.e. 6 blocks
        // of 8 (MemAvailable moves between the two reads while other processes run).
        assert_eq!(got[0], got[1], "{got:?}");
        assert!((3..=7).contains(&got[0]), "{got:?}");
        // The default caps the pool.
        let capped = [spec("target", &cpu, 1, 3)];
        assert_eq!(pool_blocks(&capped, &opts, 8).unwrap(), vec![3]);
        // Too small for one sequence: the flag is named.
        let err = pool_blocks(&specs, &opts, 100).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{FRACTION_FLAG} 1: the target KV cache gets")),
            "{err}"
        );
        assert!(err.contains(&format!("raise {FRACTION_FLAG}")), "{err}");
    }
}
