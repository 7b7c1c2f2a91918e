//! Kernel resource usage, parsed from the ptxas report in the NVRTC program log.
//!
//! The JIT always compiles with `--ptxas-options=-v`, so the program log (kept in the cache
//! next to the cubin) holds lines like these (NVRTC 13.0):
//!
//! ```text
//! ptxas info    : Compiling entry function 'afdep_router_topk' for 'sm_90a'
//! ptxas info    : Function properties for afdep_router_topk
//! ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
//! ptxas info    : Used 40 registers, used 1 barriers, 16640 bytes smem
//! ```
//!
//! Older releases print `N bytes lmem` and `N bytes cmem[0]` in the `Used` line; both forms
//! parse.

/// What ptxas reported for one function.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The function name (the `extern "C"` entry name for kernels).
    pub name: String,
    /// Whether it is a kernel entry (`Compiling entry function`), not a device function.
    pub is_entry: bool,
    /// Registers per thread.
    pub registers: u32,
    /// Named barriers used.
    pub barriers: u32,
    /// Static shared memory in bytes.
    pub shared_bytes: u64,
    /// Stack frame in bytes (local arrays and spills live there).
    pub stack_bytes: u64,
    /// Bytes of spill stores.
    pub spill_stores: u64,
    /// Bytes of spill loads.
    pub spill_loads: u64,
    /// Local memory in bytes: `lmem` or the cumulative stack size, whichever is reported.
    pub local_bytes: u64,
    /// Constant bank 0 bytes, when reported.
    pub constant_bytes: u64,
}

impl KernelResources {
    /// Whether ptxas spilled registers to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// Parses every function of a ptxas `-v` report, in the order ptxas lists them.
pub fn parse_ptxas_log(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    // The function whose "Used" line comes next, and the one whose properties come next.
    let mut current: Option<usize> = None;
    let mut props: Option<usize> = None;
    let find_or_add = |out: &mut Vec<KernelResources>, name: &str| -> usize {
        if let Some(i) = out.iter().position(|r| r.name == name) {
            i
        } else {
            out.push(KernelResources {
                name: name.to_string(),
                ..Default::default()
            });
            out.len() - 1
        }
    };
    for line in log.lines() {
        // Property lines carry a `ptxas .` prefix in NVRTC 13 and none in older releases.
        let line = line.trim_start();
        let body = line
            .strip_prefix("ptxas")
            .map(str::trim_start)
            .unwrap_or(line);
        let body = body
            .strip_prefix("info")
            .map(str::trim_start)
            .unwrap_or(body);
        let body = body.strip_prefix(':').map(str::trim_start).unwrap_or(body);
        let body = body.strip_prefix('.').map(str::trim_start).unwrap_or(body);
        if let Some(r) = body.strip_prefix("Compiling entry function") {
            let name = quoted(r).unwrap_or_default();
            let i = find_or_add(&mut out, &name);
            out[i].is_entry = true;
            current = Some(i);
        } else if let Some(r) = body.strip_prefix("Function properties for") {
            let name = r.trim().to_string();
            props = Some(find_or_add(&mut out, &name));
        } else if body.contains("bytes stack frame") {
            if let Some(i) = props {
                for field in body.split(',') {
                    let (n, what) = number_and_rest(field);
                    match what {
                        "bytes stack frame" => out[i].stack_bytes = n,
                        "bytes spill stores" => out[i].spill_stores = n,
                        "bytes spill loads" => out[i].spill_loads = n,
                        _ => {}
                    }
                }
            }
        } else if let Some(r) = body.strip_prefix("Used") {
            let Some(i) = current else { continue };
            for field in format!("Used{r}").split(',') {
                let f = field.trim();
                let f = f
                    .strip_prefix("Used")
                    .or_else(|| f.strip_prefix("used"))
                    .unwrap_or(f);
                let (n, what) = number_and_rest(f);
                match what {
                    "registers" => out[i].registers = n as u32,
                    "barriers" => out[i].barriers = n as u32,
                    "bytes smem" => out[i].shared_bytes = n,
                    "bytes lmem" | "bytes cumulative stack size" => out[i].local_bytes = n,
                    w if w.starts_with("bytes cmem[0]") => out[i].constant_bytes = n,
                    _ => {}
                }
            }
        }
    }
    out
}

/// The text between the first pair of single quotes.
fn quoted(s: &str) -> Option<String> {
    let a = s.find('\'')?;
    let b = s[a + 1..].find('\'')?;
    Some(s[a + 1..a + 1 + b].to_string())
}

/// `"  12 bytes smem"` -> `(12, "bytes smem")`; `(0, "")` when there is no number.
fn number_and_rest(s: &str) -> (u64, &str) {
    let s = s.trim();
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    match s[..end].parse() {
        Ok(n) => (n, s[end..].trim()),
        Err(_) => (0, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report captured from NVRTC 13.0 (cuda-nvrtc 13.0.88) for sm_90a.
    const NVRTC_13_0: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k2' for 'sm_90a'
ptxas info    : Function properties for k2
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
ptxas info    : Compile time = 2.261 ms
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
ptxas         .     256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 256 bytes cumulative stack size, 1024 bytes smem
ptxas info    : Compile time = 17.091 ms
";

    /// The older form (CUDA 11/12), with lmem, cmem and a spilling device function.
    const OLDER: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperv
    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Compiling entry function 'big' for 'sm_80'
ptxas info    : Function properties for big
    40 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, 40 bytes lmem, 49152 bytes smem, 380 bytes cmem[0], 8 bytes cmem[2]
";

    #[test]
    fn parses_nvrtc_13_report() {
        let r = parse_ptxas_log(NVRTC_13_0);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                name: "k2".into(),
                is_entry: true,
                registers: 10,
                ..Default::default()
            }
        );
        assert_eq!(
            r[1],
            KernelResources {
                name: "k".into(),
                is_entry: true,
                registers: 32,
                barriers: 1,
                shared_bytes: 1024,
                stack_bytes: 256,
                local_bytes: 256,
                ..Default::default()
            }
        );
        assert!(!r[1].spills());
    }

    #[test]
    fn parses_older_report_with_spills() {
        let r = parse_ptxas_log(OLDER);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].name, "_Z6helperv");
        assert!(!r[0].is_entry);
        assert_eq!(
            (r[0].spill_stores, r[0].spill_loads, r[0].stack_bytes),
            (8, 12, 24)
        );
        let big = &r[1];
        assert!(big.is_entry && big.spills());
        assert_eq!(big.registers, 255);
        assert_eq!(big.shared_bytes, 49152);
        assert_eq!(big.local_bytes, 40);
        assert_eq!(big.constant_bytes, 380);
        assert_eq!((big.spill_stores, big.spill_loads), (40, 36));
    }

    #[test]
    fn ignores_other_text() {
        assert!(parse_ptxas_log("").is_empty());
        assert!(
            parse_ptxas_log("router.cu(3): warning: something\nptxas info    : 0 bytes gmem\n")
                .is_empty()
        );
        // A "Used" line before any entry is ignored rather than misattributed.
        assert!(parse_ptxas_log("ptxas info    : Used 3 registers\n").is_empty());
    }
}
