//! The on-disk cache of compiled modules.
//!
//! **Key**: SHA-256 over the module name, every source text it is compiled from (the `.cu` and
//! all embedded headers), the NVRTC options (defines and include paths included), the NVRTC
//! version and the target architecture ([`cache_key`]).
//!
//! **Folder**: `AFDEP_KERNEL_CACHE`, else `$XDG_CACHE_HOME/afdep/kernels`, else
//! `~/.cache/afdep/kernels` ([`CacheSetting::from_env`]); `AFDEP_KERNEL_CACHE=off` disables it.
//!
//! **Entry** (`<key>.cubin`): a header of [`MAGIC`], the payload length (u64 LE) and the
//! SHA-256 of the payload, then the payload: the program log's length (u64 LE), the log
//! (UTF-8) and the cubin. A missing, truncated or corrupted entry reads as a miss and is
//! rebuilt.
//!
//! **Writes** are atomic: a uniquely named temporary file in the same folder, written and
//! fsynced, then renamed over the entry. Concurrent processes building the same entry each
//! rename a complete file; readers see the old entry, no entry, or a complete new one.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::sources::{hash_part, hex};

/// The first bytes of every cache entry (the trailing digit is the format version).
pub const MAGIC: &[u8; 8] = b"AFDEPKC1";

const HEADER_LEN: usize = 8 + 8 + 32;

/// Where the cache lives, or that there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheSetting {
    /// The default folder from the environment ([`CacheSetting::from_env`]).
    Default,
    /// This folder.
    Dir(PathBuf),
    /// No disk cache: every module is compiled.
    Disabled,
}

impl CacheSetting {
    /// `AFDEP_KERNEL_CACHE` (`off`, `0` or `none` disable the cache), else
    /// `$XDG_CACHE_HOME/afdep/kernels`, else `$HOME/.cache/afdep/kernels`; disabled when none
    /// of these is set.
    pub fn from_env() -> CacheSetting {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        if let Some(v) = var("AFDEP_KERNEL_CACHE") {
            return match v.to_str() {
                Some("off" | "0" | "none") => CacheSetting::Disabled,
                _ => CacheSetting::Dir(PathBuf::from(v)),
            };
        }
        if let Some(x) = var("XDG_CACHE_HOME") {
            return CacheSetting::Dir(PathBuf::from(x).join("afdep").join("kernels"));
        }
        if let Some(h) = var("HOME") {
            return CacheSetting::Dir(
                PathBuf::from(h)
                    .join(".cache")
                    .join("afdep")
                    .join("kernels"),
            );
        }
        CacheSetting::Disabled
    }

    /// The folder this setting names (resolving [`CacheSetting::Default`]), if any.
    pub fn resolve(&self) -> Option<PathBuf> {
        match self {
            CacheSetting::Default => CacheSetting::from_env().resolve(),
            CacheSetting::Dir(d) => Some(d.clone()),
            CacheSetting::Disabled => None,
        }
    }
}

/// Everything a compiled module depends on; [`cache_key`] hashes it.
#[derive(Debug, Clone, Copy)]
pub struct KeyParts<'a> {
    /// The module's name, e.g. `router E=64 K=8`.
    pub module: &'a str,
    /// Every source text: `(name, text)` of the `.cu` file and every header it can include.
    pub sources: &'a [(&'a str, &'a str)],
    /// The NVRTC options, in order.
    pub options: &'a [String],
    /// NVRTC's `(major, minor)` version.
    pub nvrtc_version: (i32, i32),
    /// The target architecture, e.g. `sm_90a`.
    pub arch: &'a str,
}

/// The cache key of a module: lowercase hex SHA-256 of its [`KeyParts`].
pub fn cache_key(p: &KeyParts<'_>) -> String {
    let mut h = Sha256::new();
    h.update(b"afdep-kernels cache key v1\0");
    hash_part(&mut h, p.module.as_bytes());
    h.update((p.sources.len() as u64).to_le_bytes());
    for (name, text) in p.sources {
        hash_part(&mut h, name.as_bytes());
        hash_part(&mut h, text.as_bytes());
    }
    h.update((p.options.len() as u64).to_le_bytes());
    for o in p.options {
        hash_part(&mut h, o.as_bytes());
    }
    hash_part(
        &mut h,
        format!("nvrtc {}.{}", p.nvrtc_version.0, p.nvrtc_version.1).as_bytes(),
    );
    hash_part(&mut h, p.arch.as_bytes());
    hex(&h.finalize())
}

/// A cached module: the cubin and the NVRTC program log it was built with (which holds the
/// ptxas resource report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// The cubin (an ELF image for the key's architecture).
    pub cubin: Vec<u8>,
    /// The NVRTC program log.
    pub log: String,
}

impl CacheEntry {
    /// The entry's file bytes: header, then payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut payload = Vec::with_capacity(8 + self.log.len() + self.cubin.len());
        payload.extend_from_slice(&(self.log.len() as u64).to_le_bytes());
        payload.extend_from_slice(self.log.as_bytes());
        payload.extend_from_slice(&self.cubin);
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&Sha256::digest(&payload));
        out.extend_from_slice(&payload);
        out
    }

    /// Decodes [`CacheEntry::encode`]; the reason when the bytes are not a whole, intact entry.
    pub fn decode(bytes: &[u8]) -> Result<CacheEntry, String> {
        if bytes.len() < HEADER_LEN {
            return Err(format!(
                "{} bytes, shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            ));
        }
        if &bytes[..8] != MAGIC {
            return Err("bad magic".into());
        }
        let len = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let payload = &bytes[HEADER_LEN..];
        if payload.len() as u64 != len {
            return Err(format!(
                "payload is {} bytes, the header says {len}",
                payload.len()
            ));
        }
        if Sha256::digest(payload).as_slice() != &bytes[16..48] {
            return Err("payload checksum mismatch".into());
        }
        if payload.len() < 8 {
            return Err("payload too short".into());
        }
        let log_len = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
        let rest = &payload[8..];
        if log_len > rest.len() as u64 {
            return Err("log length past the end".into());
        }
        let (log, cubin) = rest.split_at(log_len as usize);
        let log = String::from_utf8(log.to_vec()).map_err(|_| "log is not UTF-8".to_string())?;
        Ok(CacheEntry {
            cubin: cubin.to_vec(),
            log,
        })
    }
}

/// The on-disk cache of one folder.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl KernelCache {
    /// A cache in `dir` (created on first store).
    pub fn new(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    /// The cache a setting names, if any.
    pub fn from_setting(s: &CacheSetting) -> Option<KernelCache> {
        s.resolve().map(KernelCache::new)
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of a key.
    pub fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.cubin"))
    }

    /// The entry of `key`: `None` when absent; a damaged entry is logged and reads as absent.
    pub fn load(&self, key: &str) -> Option<CacheEntry> {
        let path = self.path_of(key);
        let mut bytes = Vec::new();
        match File::open(&path).and_then(|mut f| f.read_to_end(&mut bytes)) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "kernel cache: unreadable entry, rebuilding");
                return None;
            }
        }
        match CacheEntry::decode(&bytes) {
            Ok(e) => {
                tracing::debug!(path = %path.display(), "kernel cache hit");
                Some(e)
            }
            Err(why) => {
                tracing::warn!(path = %path.display(), %why, "kernel cache: corrupted entry, rebuilding");
                None
            }
        }
    }

    /// Stores `entry` under `key` atomically (temporary file, fsync, rename).
    pub fn store(&self, key: &str, entry: &CacheEntry) -> io::Result<PathBuf> {
        fs::create_dir_all(&self.dir)?;
        let bytes = entry.encode();
        let (tmp, mut file) = self.create_temp(key)?;
        let written = file.write_all(&bytes).and_then(|_| file.sync_all());
        drop(file);
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        let path = self.path_of(key);
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        // Make the rename itself durable (best effort: not every platform can sync a folder).
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(path)
    }

    /// A new, uniquely named temporary file next to the entries.
    fn create_temp(&self, key: &str) -> io::Result<(PathBuf, File)> {
        let pid = std::process::id();
        loop {
            let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let tmp = self.dir.join(format!(".{key}.{pid}.{n}.{nanos}.tmp"));
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(f) => return Ok((tmp, f)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// The entry of `key`, built with `build` and stored when absent or damaged. The flag is
    /// whether it came from the cache. A failed store is logged, not returned: the cache is
    /// an optimisation.
    pub fn get_or_build<E>(
        &self,
        key: &str,
        build: impl FnOnce() -> Result<CacheEntry, E>,
    ) -> Result<(CacheEntry, bool), E> {
        if let Some(e) = self.load(key) {
            return Ok((e, true));
        }
        let entry = build()?;
        if let Err(e) = self.store(key, &entry) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "kernel cache: cannot store entry");
        }
        Ok((entry, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts<'a>(sources: &'a [(&'a str, &'a str)], options: &'a [String]) -> KeyParts<'a> {
        KeyParts {
            module: "router E=64 K=8",
            sources,
            options,
            nvrtc_version: (13, 0),
            arch: "sm_90a",
        }
    }

    fn entry(n: u8) -> CacheEntry {
        CacheEntry {
            cubin: vec![0x7f, b'E', b'L', b'F', n, 1, 2, 3],
            log: format!("ptxas info : log {n}"),
        }
    }

    #[test]
    fn key_changes_with_every_part() {
        let src = [("router.cu", "kernel A"), ("common/ptx.cuh", "helpers")];
        let opts = vec![
            "--gpu-architecture=sm_90a".to_string(),
            "-DAFDEP_TOP_K=8".to_string(),
        ];
        let base = cache_key(&parts(&src, &opts));
        assert_eq!(base.len(), 64);
        assert_eq!(base, cache_key(&parts(&src, &opts)), "stable");

        let src2 = [("router.cu", "kernel B"), ("common/ptx.cuh", "helpers")];
        assert_ne!(base, cache_key(&parts(&src2, &opts)), "main source");
        let src3 = [("router.cu", "kernel A"), ("common/ptx.cuh", "helpers!")];
        assert_ne!(base, cache_key(&parts(&src3, &opts)), "an included header");
        let src4 = [("router.cu", "kernel A"), ("common/ptx.cuhhelpers", "")];
        assert_ne!(
            base,
            cache_key(&parts(&src4, &opts)),
            "name/text boundaries"
        );
        let opts2 = vec![
            "--gpu-architecture=sm_90a".to_string(),
            "-DAFDEP_TOP_K=6".to_string(),
        ];
        assert_ne!(base, cache_key(&parts(&src, &opts2)), "options");
        let mut p = parts(&src, &opts);
        p.nvrtc_version = (13, 1);
        assert_ne!(base, cache_key(&p), "NVRTC version");
        let mut p = parts(&src, &opts);
        p.arch = "sm_100a";
        assert_ne!(base, cache_key(&p), "arch");
        let mut p = parts(&src, &opts);
        p.module = "router E=96 K=8";
        assert_ne!(base, cache_key(&p), "module");
    }

    #[test]
    fn entry_round_trips_and_detects_damage() {
        let e = entry(1);
        let bytes = e.encode();
        assert_eq!(CacheEntry::decode(&bytes), Ok(e.clone()));
        // Truncated anywhere.
        for cut in [0, 5, HEADER_LEN - 1, HEADER_LEN, bytes.len() - 1] {
            assert!(CacheEntry::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        // Any single flipped byte.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(CacheEntry::decode(&b).is_err(), "flip at {i}");
        }
        // Trailing garbage.
        let mut b = bytes.clone();
        b.push(0);
        assert!(CacheEntry::decode(&b).is_err());
    }

    #[test]
    fn store_is_atomic_and_leaves_no_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let c = KernelCache::new(dir.path().join("nested/kernels"));
        assert_eq!(c.load("k"), None);
        let p = c.store("k", &entry(1)).unwrap();
        assert_eq!(p, c.path_of("k"));
        assert_eq!(c.load("k"), Some(entry(1)));
        c.store("k", &entry(2)).unwrap();
        assert_eq!(c.load("k"), Some(entry(2)), "overwrites");
        let names: Vec<_> = fs::read_dir(c.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("k.cubin")]);
    }

    #[test]
    fn corrupted_entry_is_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let c = KernelCache::new(dir.path());
        let mut builds = 0;
        // A miss that builds (and stores) the entry.
        let mut build = || {
            let (e, hit) = c
                .get_or_build::<()>("k", || {
                    builds += 1;
                    Ok(entry(1))
                })
                .unwrap();
            assert_eq!((e, hit), (entry(1), false));
        };
        build();
        let (_, hit) = c.get_or_build::<()>("k", || unreachable!()).unwrap();
        assert!(hit);

        // Truncate the entry: a miss, then rebuilt and stored whole again.
        let path = c.path_of("k");
        let full = fs::read(&path).unwrap();
        fs::write(&path, &full[..full.len() / 2]).unwrap();
        assert_eq!(c.load("k"), None);
        build();
        assert_eq!(fs::read(&path).unwrap(), full);

        // Flip a payload byte: detected by the checksum.
        let mut bad = full.clone();
        *bad.last_mut().unwrap() ^= 1;
        fs::write(&path, &bad).unwrap();
        assert_eq!(c.load("k"), None);
        // Garbage of the right length.
        fs::write(&path, vec![0u8; full.len()]).unwrap();
        assert_eq!(c.load("k"), None);
        assert_eq!(builds, 2);
    }

    #[test]
    fn build_errors_pass_through_and_store_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let c = KernelCache::new(dir.path());
        assert_eq!(
            c.get_or_build("k", || Err::<CacheEntry, _>("nvrtc said no")),
            Err("nvrtc said no")
        );
        assert_eq!(c.load("k"), None);
    }

    #[test]
    fn concurrent_writers_and_readers() {
        let dir = tempfile::tempdir().unwrap();
        let c = KernelCache::new(dir.path());
        // A large entry makes torn writes likely to be seen if writes were not atomic.
        let big = CacheEntry {
            cubin: (0..1 << 20).map(|i| (i % 251) as u8).collect(),
            log: "log".repeat(1000),
        };
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..10 {
                        c.store("k", &big).unwrap();
                    }
                });
            }
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        // Every read sees nothing yet, or the whole entry: never a torn one.
                        if let Some(e) = c.load("k") {
                            assert_eq!(e, big);
                        }
                    }
                });
            }
            for _ in 0..4 {
                s.spawn(|| {
                    let (e, _) = c.get_or_build::<()>("k2", || Ok(big.clone())).unwrap();
                    assert_eq!(e, big);
                });
            }
        });
        assert_eq!(c.load("k"), Some(big.clone()));
        assert_eq!(c.load("k2"), Some(big));
        let mut names: Vec<_> = fs::read_dir(c.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            vec!["k.cubin", "k2.cubin"],
            "no temporary files remain"
        );
    }

    #[test]
    fn setting_from_env_resolution() {
        assert_eq!(CacheSetting::Disabled.resolve(), None);
        assert_eq!(
            CacheSetting::Dir("/x".into()).resolve(),
            Some(PathBuf::from("/x"))
        );
    }
}
