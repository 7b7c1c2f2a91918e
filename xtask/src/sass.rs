//! The SASS check of `cargo xtask kernels --sass`: disassembles every cubin of the kernel cache
//! the compile run filled, with nvdisasm, and checks what the GEMM kernels compiled to.
//!
//! **Rules**: every `afdep_gemm_*` kernel except `afdep_gemm_reduce` (which multiplies
//! nothing) contains at least one `HGMMA` (Hopper wgmma) instruction and no `HMMA` (the
//! `mma.sync` tensor-core path, which would mean the wgmma path was lost); every one of them
//! but the weight gradient (`afdep_gemm_wgrad`, whose operands are gathered and cut at group
//! ends, so it loads by cp.async only) contains a `UTMALDG` (its dense operands load by TMA).
//! A table per GEMM
//! kernel reports the `HGMMA`, `HMMA`, `LDGSTS` (cp.async), `UTMALDG` (TMA load) and
//! `BAR.SYNC` counts; a broken rule fails the command with the kernel's name.
//!
//! **Cache entries** are read by their documented header (crates/afdep-kernels/src/cache.rs:
//! `AFDEPKC1`, the payload length as u64 LE, the payload's SHA-256, then the payload: the
//! log's length as u64 LE, the log and the cubin). The checksum is not verified here (xtask
//! has no SHA-256); the length checks and the cubin's ELF magic catch a damaged entry.
//!
//! **Output**: the SASS of the GEMM module (code sections, with source lines and inlining
//! annotated) is written to `target/sass/gemm.sass` for reading.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

/// The first bytes of a kernel cache entry (`afdep_kernels::cache::MAGIC`).
const ENTRY_MAGIC: &[u8; 8] = b"AFDEPKC1";
/// Magic, payload length (u64 LE) and the payload's SHA-256.
const ENTRY_HEADER_LEN: usize = 8 + 8 + 32;
/// The prefix of the kernels the rules apply to.
const GEMM_PREFIX: &str = "afdep_gemm_";
/// The GEMM module's kernel that is exempt from the rules (a plain reduction, no MMA).
const GEMM_EXEMPT: &[&str] = &["afdep_gemm_reduce"];
/// Checked GEMM kernels that load every operand by cp.async (no TMA rule).
const CP_ASYNC_ONLY: &[&str] = &["afdep_gemm_wgrad"];

/// The cubin (ELF image) inside the bytes of a kernel cache entry; the reason when the bytes
/// are not a whole entry or the payload holds no ELF image.
pub fn entry_cubin(bytes: &[u8]) -> Result<&[u8], String> {
    if bytes.len() < ENTRY_HEADER_LEN {
        return Err(format!(
            "{} bytes, shorter than the {ENTRY_HEADER_LEN}-byte header",
            bytes.len()
        ));
    }
    if &bytes[..8] != ENTRY_MAGIC {
        return Err("bad magic (not an AFDEPKC1 cache entry)".into());
    }
    let len = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    let payload = &bytes[ENTRY_HEADER_LEN..];
    if payload.len() as u64 != len {
        return Err(format!(
            "payload is {} bytes, the header says {len}",
            payload.len()
        ));
    }
    if payload.len() < 8 {
        return Err("payload too short for the log length".into());
    }
    let log_len = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
    let rest = &payload[8..];
    if log_len > rest.len() as u64 {
        return Err("log length past the end".into());
    }
    let cubin = &rest[log_len as usize..];
    if !cubin.starts_with(b"\x7fELF") {
        return Err("the cubin does not start with the ELF magic".into());
    }
    Ok(cubin)
}

/// One function of a disassembly: its name and its instructions' opcodes with their
/// modifiers (`HGMMA.64x128x16.F32.BF16`, `BAR.SYNC.DEFER_BLOCKING`), in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// The function's symbol (the `<name>` of its `.text.<name>` section).
    pub name: String,
    /// The opcodes, predicates and operands left out.
    pub opcodes: Vec<String>,
}

/// The opcode of one SASS instruction line (`/*0040*/  @!P0 HGMMA.64x128x16.F32.BF16 R24, ...;`):
/// `None` for labels, directives (`.byte`, `.align`), comments and blank lines.
fn opcode(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("/*")?;
    let (addr, rest) = rest.split_once("*/")?;
    if addr.is_empty() || !addr.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut tokens = rest
        .trim_start()
        .trim_start_matches('{')
        .split(|c: char| c.is_whitespace() || c == ';')
        .filter(|t| !t.is_empty());
    let mut op = tokens.next()?;
    if op.starts_with('@') {
        op = tokens.next()?;
    }
    op.starts_with(|c: char| c.is_ascii_uppercase())
        .then_some(op)
}

/// Splits nvdisasm output into functions: a function starts at its `.section .text.<name>`
/// directive (or, in output without section directives, at its `.text.<name>:` label) and
/// ends at the next section. Local labels and the internal subroutines ptxas appends to a
/// kernel (`$__internal_0_$__cuda_sm20_div_u64:`) stay with the kernel they are compiled into.
pub fn split_functions(sass: &str) -> Vec<Function> {
    let mut out: Vec<Function> = Vec::new();
    let mut current: Option<Function> = None;
    for line in sass.lines() {
        let t = line.trim();
        let start = if let Some(rest) = t
            .strip_prefix(".section")
            .filter(|r| r.starts_with(char::is_whitespace))
        {
            // Not `.sectionflags` or `.sectioninfo`, which belong to the current section.
            let section = rest.trim_start().split(',').next().unwrap_or("").trim();
            out.extend(current.take());
            section.strip_prefix(".text.")
        } else if let Some(label) = t.strip_prefix(".text.").and_then(|l| l.strip_suffix(':')) {
            match &current {
                Some(f) if f.name == label => None,
                _ => {
                    out.extend(current.take());
                    Some(label)
                }
            }
        } else {
            None
        };
        if let Some(name) = start {
            current = Some(Function {
                name: name.to_string(),
                opcodes: Vec::new(),
            });
        } else if let (Some(f), Some(op)) = (current.as_mut(), opcode(t)) {
            f.opcodes.push(op.to_string());
        }
    }
    out.extend(current);
    out
}

/// The instruction counts of the table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// `HGMMA`: Hopper warpgroup MMA (wgmma).
    pub hgmma: usize,
    /// `HMMA`: warp-level MMA (`mma.sync`).
    pub hmma: usize,
    /// `LDGSTS`: global to shared asynchronous copies (cp.async).
    pub ldgsts: usize,
    /// `UTMALDG`: TMA tensor loads.
    pub utmaldg: usize,
    /// `BAR.SYNC`: CTA barriers (`__syncthreads`, `bar.sync`).
    pub bar_sync: usize,
    /// Every instruction.
    pub total: usize,
}

impl Function {
    /// Counts the instructions of the table, by opcode (modifiers ignored: `HFMA2.MMA` is
    /// not an `HMMA`).
    pub fn counts(&self) -> Counts {
        let mut c = Counts {
            total: self.opcodes.len(),
            ..Counts::default()
        };
        for op in &self.opcodes {
            let mut parts = op.split('.');
            match parts.next().unwrap_or("") {
                "HGMMA" => c.hgmma += 1,
                "HMMA" => c.hmma += 1,
                "LDGSTS" => c.ldgsts += 1,
                "UTMALDG" => c.utmaldg += 1,
                "BAR" if parts.next() == Some("SYNC") => c.bar_sync += 1,
                _ => {}
            }
        }
        c
    }
}

/// Whether the rules apply to a function: an `afdep_gemm_*` kernel other than the exempt ones.
fn is_checked_gemm(name: &str) -> bool {
    name.starts_with(GEMM_PREFIX) && !GEMM_EXEMPT.contains(&name)
}

/// The broken rules of `functions`, one message naming the kernel each.
pub fn violations(functions: &[Function]) -> Vec<String> {
    functions.iter().flat_map(function_violations).collect()
}

/// The broken rules of one function (none for an unchecked one).
fn function_violations(f: &Function) -> Vec<String> {
    let mut v = Vec::new();
    if is_checked_gemm(&f.name) {
        let c = f.counts();
        if c.hgmma == 0 {
            v.push(format!(
                "{}: no HGMMA instruction (the wgmma path is missing)",
                f.name
            ));
        }
        if c.hmma > 0 {
            v.push(format!(
                "{}: {} HMMA instruction(s) (mma.sync tensor cores, not wgmma)",
                f.name, c.hmma
            ));
        }
        if c.utmaldg == 0 && !CP_ASYNC_ONLY.contains(&f.name.as_str()) {
            v.push(format!(
                "{}: no UTMALDG instruction (the TMA loads of the dense operands are missing)",
                f.name
            ));
        }
    }
    v
}

/// The table of the `afdep_gemm_*` functions: the counts and whether each passes the rules.
pub fn table(functions: &[Function]) -> String {
    let mut s = String::new();
    let row = |s: &mut String, cols: [&str; 8]| {
        let _ = writeln!(
            s,
            "{:<24} {:>6} {:>5} {:>7} {:>8} {:>9} {:>7}  {}",
            cols[0], cols[1], cols[2], cols[3], cols[4], cols[5], cols[6], cols[7]
        );
    };
    row(
        &mut s,
        [
            "kernel", "HGMMA", "HMMA", "LDGSTS", "UTMALDG", "BAR.SYNC", "instrs", "rules",
        ],
    );
    for f in functions.iter().filter(|f| f.name.starts_with(GEMM_PREFIX)) {
        let c = f.counts();
        let verdict = if !is_checked_gemm(&f.name) {
            "exempt"
        } else if function_violations(f).is_empty() {
            "ok"
        } else {
            "FAILED"
        };
        let n = [c.hgmma, c.hmma, c.ldgsts, c.utmaldg, c.bar_sync, c.total].map(|x| x.to_string());
        row(
            &mut s,
            [&f.name, &n[0], &n[1], &n[2], &n[3], &n[4], &n[5], verdict],
        );
    }
    s
}

/// Disassembles one cubin file with `nvdisasm -c -gi` (code sections, source lines with
/// inlining).
fn disassemble(nvdisasm: &Path, cubin: &Path) -> Result<String> {
    let out = Command::new(nvdisasm)
        .args(["-c", "-gi"])
        .arg(cubin)
        .output()
        .with_context(|| format!("starting {}", nvdisasm.display()))?;
    if !out.status.success() {
        bail!(
            "`{} -c -gi {}` failed ({}): {}",
            nvdisasm.display(),
            cubin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout)
        .with_context(|| format!("nvdisasm's output for {} is not UTF-8", cubin.display()))
}

/// The `<key>.cubin` entries of a kernel cache folder, sorted (temporary files left out).
fn cache_entries(cache: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(cache)
        .with_context(|| format!("reading the kernel cache {}", cache.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            n.ends_with(".cubin") && !n.starts_with('.') && p.is_file()
        })
        .collect();
    v.sort();
    Ok(v)
}

/// Disassembles every cubin of the kernel cache `cache` with `nvdisasm`, writes the GEMM
/// module's SASS to `<out>/gemm.sass`, prints the table and fails on a broken rule.
pub fn check(nvdisasm: &Path, cache: &Path, out: &Path) -> Result<()> {
    let entries = cache_entries(cache)?;
    if entries.is_empty() {
        bail!(
            "the kernel cache {} holds no entry to disassemble",
            cache.display()
        );
    }
    let cubins = out.join("cubins");
    let _ = std::fs::remove_dir_all(&cubins);
    std::fs::create_dir_all(&cubins).with_context(|| format!("creating {}", cubins.display()))?;
    let mut jobs = Vec::new();
    for e in &entries {
        let bytes = std::fs::read(e).with_context(|| format!("reading {}", e.display()))?;
        let cubin = entry_cubin(&bytes)
            .map_err(|why| anyhow::anyhow!("kernel cache entry {}: {why}", e.display()))?;
        let file = cubins.join(e.file_name().expect("an entry file"));
        std::fs::write(&file, cubin).with_context(|| format!("writing {}", file.display()))?;
        jobs.push(file);
    }
    eprintln!(
        "xtask: disassembling {} cubins of {} with {}",
        jobs.len(),
        cache.display(),
        nvdisasm.display()
    );

    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(jobs.len());
    let next = Mutex::new(0usize);
    let results: Mutex<Vec<(usize, Result<String>)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = {
                        let mut n = next.lock().unwrap();
                        *n += 1;
                        *n - 1
                    };
                    let Some(file) = jobs.get(i) else { break };
                    let r = disassemble(nvdisasm, file);
                    results.lock().unwrap().push((i, r));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);
    let _ = std::fs::remove_dir_all(&cubins);

    let mut gemm_modules = Vec::new();
    let mut functions = Vec::new();
    for (i, r) in results {
        let text = r?;
        let fs = split_functions(&text);
        if fs.is_empty() {
            bail!(
                "no function in the disassembly of {} (nvdisasm output not understood)",
                entries[i].display()
            );
        }
        if fs.iter().any(|f| f.name.starts_with(GEMM_PREFIX)) {
            gemm_modules.push((i, text));
        }
        functions.extend(fs);
    }
    match gemm_modules.as_slice() {
        [] => bail!(
            "no {GEMM_PREFIX}* kernel in any of the {} cubins of {}",
            entries.len(),
            cache.display()
        ),
        [(_, text)] => {
            let path = out.join("gemm.sass");
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("xtask: GEMM module SASS in {}", path.display());
        }
        many => bail!(
            "{} cubins of {} define {GEMM_PREFIX}* kernels (one GEMM module expected): {}",
            many.len(),
            cache.display(),
            many.iter()
                .map(|(i, _)| entries[*i].display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }

    println!();
    println!(
        "SASS of the GEMM kernels ({} functions in {} cubins disassembled):",
        functions.len(),
        entries.len()
    );
    print!("{}", table(&functions));
    let v = violations(&functions);
    if v.is_empty() {
        println!("OK: every {GEMM_PREFIX}* kernel (but the exempt) uses HGMMA and no HMMA");
        return Ok(());
    }
    for m in &v {
        eprintln!("FAILED: {m}");
    }
    bail!("SASS check: {} broken rule(s): {}", v.len(), v.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An abridged `nvdisasm -c -gi` output: three GEMM kernels (one on the mma.sync path,
    /// one without any MMA), the exempt reduction and a non-GEMM kernel with HMMA.
    const SNIPPET: &str = r#"
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
	.elftype	@"ET_EXEC"


//--------------------- .text.afdep_gemm_reduce  --------------------------
	.section	.text.afdep_gemm_reduce,"ax",@progbits
	.align	128
        .global         afdep_gemm_reduce
        .type           afdep_gemm_reduce,@function
afdep_gemm_reduce:
.text.afdep_gemm_reduce:
	//## File "/work/main/gemm.cu", line 551
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   FADD R4, R4, R5 ;
        /*0020*/                   EXIT ;
$__internal_0_$__cuda_sm20_div_u64:
        /*0030*/                   HFMA2.MMA R7, -RZ, RZ, 0, 0 ;
        /*0040*/                   RET.REL.NODEC R6 `(afdep_gemm_reduce) ;
.L_x_1:
//--------------------- .text.afdep_gemm_up_swiglu --------------------------
	.section	.text.afdep_gemm_up_swiglu,"ax",@progbits
	.sectionflags	@"SHF_BARRIERS=1"
	.sectioninfo	@"SHI_REGISTERS=168"
afdep_gemm_up_swiglu:
.text.afdep_gemm_up_swiglu:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 LDGSTS.E.BYPASS.128 [R7], desc[UR22][R28.64], P1 ;
        /*0020*/                   LDGDEPBAR ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   WARPGROUP.ARRIVE ;
	//## File "/work/main/gemm.cu", line 121 inlined at "/work/main/gemm.cu", line 153
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24].tnspA.tnspB, R24 ;
        /*0060*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR28].tnspA.tnspB, R24, gsb0 ;
        /*0070*/                   BAR.ARV 0x1, 0x100 ;
        /*0080*/               @P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/                   UTMALDG.2D [UR8], [UR4] ;
        /*00a0*/                   EXIT ;
//--------------------- .text.afdep_gemm_down_store --------------------------
	.section	.text.afdep_gemm_down_store,"ax",@progbits
afdep_gemm_down_store:
.text.afdep_gemm_down_store:
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24], RZ, !UPT ;
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0020*/                   EXIT ;
	.section	.text.afdep_gemm_wgrad,"ax",@progbits
afdep_gemm_wgrad:
.text.afdep_gemm_wgrad:
        /*0000*/                   FFMA R4, R5, R6, R4 ;
        /*0010*/                   EXIT ;
	.section	.text.afdep_router_logits,"ax",@progbits
afdep_router_logits:
.text.afdep_router_logits:
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0010*/                   EXIT ;
	.section	.nv.shared.afdep_gemm_up_swiglu,"aw",@nobits
        /*0000*/ 	.byte	0x00, 0x01
"#;

    fn by_name<'a>(fs: &'a [Function], name: &str) -> &'a Function {
        fs.iter().find(|f| f.name == name).expect(name)
    }

    #[test]
    fn opcodes_skip_predicates_directives_and_labels() {
        assert_eq!(
            opcode("        /*0010*/              @!P0 BRA `(.L_x_2) ;"),
            Some("BRA")
        );
        assert_eq!(
            opcode("  /*4920*/  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24], R24 ;"),
            Some("HGMMA.64x128x16.F32.BF16")
        );
        assert_eq!(
            opcode("        /*0460*/                   NOP;"),
            Some("NOP")
        );
        assert_eq!(opcode("        /*0000*/ 	.byte	0xff, 0xff"), None);
        assert_eq!(opcode("afdep_gemm_reduce:"), None);
        assert_eq!(opcode("\t//## File \"gemm.cu\", line 1"), None);
        assert_eq!(opcode("/* 0x000fe40000000800 */"), None);
    }

    #[test]
    fn splits_per_function_and_counts() {
        let fs = split_functions(SNIPPET);
        let names: Vec<&str> = fs.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "afdep_gemm_reduce",
                "afdep_gemm_up_swiglu",
                "afdep_gemm_down_store",
                "afdep_gemm_wgrad",
                "afdep_router_logits"
            ],
            "the .nv.shared section ends the last function and starts none"
        );
        // The internal subroutine stays with its kernel; HFMA2.MMA is not an HMMA.
        let reduce = by_name(&fs, "afdep_gemm_reduce");
        assert_eq!(reduce.opcodes.len(), 5);
        assert_eq!(reduce.counts().hmma, 0);
        assert_eq!(
            by_name(&fs, "afdep_gemm_up_swiglu").counts(),
            Counts {
                hgmma: 2,
                hmma: 0,
                ldgsts: 1,
                utmaldg: 1,
                bar_sync: 2,
                total: 11
            },
            "predicated instructions count; BAR.ARV is not a BAR.SYNC"
        );
        let down = by_name(&fs, "afdep_gemm_down_store").counts();
        assert_eq!((down.hgmma, down.hmma), (1, 1));
    }

    #[test]
    fn labels_alone_split_too() {
        let text = ".text.afdep_gemm_a:\n /*0000*/ HGMMA.64x128x16.F32.BF16 R0 ;\n\
                    .text.afdep_gemm_b:\n /*0000*/ HMMA.16816.F32.BF16 R4 ;\n";
        let fs = split_functions(text);
        assert_eq!(fs.len(), 2);
        assert_eq!(fs[0].counts().hgmma, 1);
        assert_eq!(fs[1].counts().hmma, 1);
    }

    #[test]
    fn rules_report_the_offending_kernels() {
        let fs = split_functions(SNIPPET);
        let v = violations(&fs);
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(
            v[0].starts_with("afdep_gemm_down_store: 1 HMMA"),
            "the kernel with HMMA is reported: {v:?}"
        );
        assert!(
            v[1].starts_with("afdep_gemm_down_store: no UTMALDG"),
            "the rows kernel without TMA loads is reported: {v:?}"
        );
        assert!(
            v[2].starts_with("afdep_gemm_wgrad: no HGMMA"),
            "the kernel without HGMMA is reported (and not for TMA: it is cp.async only): {v:?}"
        );
        // Neither the exempt reduction nor a non-GEMM kernel with HMMA is reported.
        assert!(
            !v.iter()
                .any(|m| m.contains("reduce") || m.contains("router"))
        );

        let t = table(&fs);
        let line = |k: &str| t.lines().find(|l| l.starts_with(k)).expect(k).to_string();
        assert!(line("afdep_gemm_up_swiglu").ends_with("ok"));
        assert!(line("afdep_gemm_down_store").ends_with("FAILED"));
        assert!(line("afdep_gemm_wgrad").ends_with("FAILED"));
        assert!(line("afdep_gemm_reduce").ends_with("exempt"));
        assert!(!t.contains("afdep_router_logits"));

        // A module whose GEMM kernels all follow the rules passes.
        let good: Vec<Function> = fs
            .into_iter()
            .filter(|f| f.name != "afdep_gemm_down_store" && f.name != "afdep_gemm_wgrad")
            .collect();
        assert_eq!(violations(&good), Vec::<String>::new());
    }

    #[test]
    fn cache_entry_cubin_by_header() {
        let log = b"ptxas info : 0 bytes stack frame";
        let cubin = b"\x7fELF\x02\x01\x01rest of the image";
        let mut payload = (log.len() as u64).to_le_bytes().to_vec();
        payload.extend_from_slice(log);
        payload.extend_from_slice(cubin);
        let mut entry = ENTRY_MAGIC.to_vec();
        entry.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        entry.extend_from_slice(&[0u8; 32]);
        entry.extend_from_slice(&payload);
        assert_eq!(entry_cubin(&entry), Ok(&cubin[..]));

        assert!(entry_cubin(&entry[..entry.len() - 1]).is_err(), "truncated");
        assert!(entry_cubin(&entry[..20]).is_err(), "header only");
        let mut bad = entry.clone();
        bad[0] = b'X';
        assert!(entry_cubin(&bad).is_err(), "magic");
        let mut bad = entry.clone();
        bad[ENTRY_HEADER_LEN] ^= 1; // the log length: the cubin no longer starts at ELF
        assert!(entry_cubin(&bad).is_err(), "log length");
    }
}
