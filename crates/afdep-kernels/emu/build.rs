//! Builds the emulated kernels: copies ../cuda, swaps common/ptx.cuh for the shim's, and
//! compiles one translation unit per specialisation (entry names suffixed per unit).

use std::fmt::Write;
use std::path::Path;

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let d = dst.join(p.file_name().unwrap());
        if p.is_dir() { copy_dir(&p, &d) } else { std::fs::copy(&p, &d).unwrap(); }
    }
}

fn main() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let cuda = out.join("cuda");
    let _ = std::fs::remove_dir_all(&cuda);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cuda");
    copy_dir(&src, &cuda);
    std::fs::copy("shim/common/ptx.cuh", cuda.join("common/ptx.cuh")).unwrap();
    println!("cargo:rerun-if-changed=../cuda");
    println!("cargo:rerun-if-changed=shim");
    let mut files = vec![];
    let mut tu = |name: String, body: String| {
        let p = out.join(format!("{name}.cpp"));
        std::fs::write(&p, body).unwrap();
        files.push(p);
    };
    for (e, k) in [(96, 6), (64, 8), (128, 1), (64, 2), (96, 8)] {
        let s = format!("e{e}_k{k}");
        let mut b = String::new();
        writeln!(b, "#include \"emu.h\"\n#define AFDEP_BLOCK 256\n#define AFDEP_EXPERTS {e}\n#define AFDEP_TOP_K {k}").unwrap();
        writeln!(b, "#define afdep_router_logits afdep_router_logits_{s}\n#define afdep_router_topk afdep_router_topk_{s}").unwrap();
        writeln!(b, "#include \"router.cu\"").unwrap();
        writeln!(b, "extern \"C\" void emu_router_logits_{s}(const u16* x, const u16* wr, float* l, u32 t, u32 h) {{ emu_launch({{(t + 63) / 64, ({e} + 63) / 64, 1}}, {{256, 1, 1}}, [&] {{ afdep_router_logits_{s}(x, wr, l, t, h); }}); }}").unwrap();
        writeln!(b, "extern \"C\" void emu_router_topk_{s}(const float* l, i32* idx, float* w, u32 t, u32 r) {{ emu_launch({{(t + 7) / 8, 1, 1}}, {{256, 1, 1}}, [&] {{ afdep_router_topk_{s}(l, idx, w, t, r, nullptr); }}); }}").unwrap();
        tu(format!("router_{s}"), b);
    }
    for k in [1, 2, 6, 8] {
        let s = format!("k{k}");
        let mut b = String::new();
        writeln!(b, "#include \"emu.h\"\n#define AFDEP_BLOCK 256\n#define AFDEP_TOP_K {k}").unwrap();
        writeln!(b, "#define afdep_validate_scan afdep_validate_scan_{s}\n#define afdep_validate_word afdep_validate_word_{s}").unwrap();
        writeln!(b, "#define afdep_check_token afdep_check_token_{s}\n#define Offence Offence_{s}").unwrap();
        writeln!(b, "#include \"validate.cu\"").unwrap();
        writeln!(b, "extern \"C\" void emu_validate_{s}(const i32* idx, const float* w, u32* st, u64 t, u64 e, u64 o, u64 c, u32 rank, u32 blocks) {{ emu_launch({{blocks, 1, 1}}, {{256, 1, 1}}, [&] {{ afdep_validate_scan_{s}(idx, w, st, t, e, o, c); }}); emu_launch({{1, 1, 1}}, {{32, 1, 1}}, [&] {{ afdep_validate_word_{s}(idx, w, st, t, e, o, c, rank, nullptr, e); }}); }}").unwrap();
        writeln!(b, "#define afdep_permute afdep_permute_{s}\n#define afdep_unpermute afdep_unpermute_{s}").unwrap();
        writeln!(b, "#undef K\n#include \"permute.cu\"").unwrap();
        writeln!(b, "extern \"C\" void emu_permute_{s}(const u16* x, const u32* rs, const u64* tot, u16* xs, u64 mr, u32 h) {{ emu_launch({{(u32)((mr + 7) / 8), 1, 1}}, {{256, 1, 1}}, [&] {{ afdep_permute_{s}(x, rs, tot, xs, mr, h); }}); }}").unwrap();
        writeln!(b, "extern \"C\" void emu_unpermute_{s}(const u16* y, const u32* sr, const i32* idx, const float* w, u16* out, u64 t, u32 h, u32 g) {{ emu_launch({{(u32)((t + 7) / 8), 1, 1}}, {{256, 1, 1}}, [&] {{ afdep_unpermute_{s}(y, sr, idx, w, out, t, h, g); }}); }}").unwrap();
        tu(format!("vp_{s}"), b);
    }
    for e in [64, 96, 128] {
        let s = format!("e{e}");
        let mut b = String::new();
        writeln!(b, "#include \"emu.h\"\n#define AFDEP_BLOCK 256\n#define AFDEP_EXPERTS {e}\n#define AFDEP_LAYOUT_CHUNK 4096").unwrap();
        for n in ["afdep_layout_count", "afdep_layout_scan_blocks", "afdep_layout_scan_experts", "afdep_layout_scatter", "afdep_block_exclusive_scan", "afdep_valid_expert"] {
            writeln!(b, "#define {n} {n}_{s}").unwrap();
        }
        writeln!(b, "#include \"layout.cu\"").unwrap();
        writeln!(b, "extern \"C\" void emu_layout_{s}(const i32* idx, u32* bc, u64* counts, u64* offsets, u32* slot_row, u32* row_slot, u64 slots, u32 nb) {{
            emu_launch({{nb, 1, 1}}, {{256, 1, 1}}, [&] {{ afdep_layout_count_{s}(idx, bc, slots, nb); }});
            emu_launch({{{e}, 1, 1}}, {{256, 1, 1}}, [&] {{ afdep_layout_scan_blocks_{s}(bc, counts, nb); }});
            emu_launch({{1, 1, 1}}, {{256, 1, 1}}, [&] {{ afdep_layout_scan_experts_{s}(counts, offsets); }});
            emu_launch({{nb, 1, 1}}, {{256, 1, 1}}, [&] {{ afdep_layout_scatter_{s}(idx, bc, offsets, slot_row, row_slot, slots, nb); }});
        }}").unwrap();
        tu(format!("layout_{s}"), b);
    }
    let mut c = cc::Build::new();
    c.cpp(true).std("c++20").flag("-ffp-contract=off").flag("-w").opt_level(2)
        .include(&cuda).include("shim").file("shim/emu.cpp");
    for f in &files { c.file(f); }
    c.compile("emu");
}
