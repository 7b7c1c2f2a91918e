//! Unit tests of `afdep exchange`.

use super::*;
use super::{args::*, problem::*, ranks::*, rounds::*, rows::*};
use afdep_core::ExchangeConfig;
use afdep_moe::{DispatchArm, RoundArm};

fn row(mode: &str, phases: Option<f64>) -> ExchangeRow {
    ExchangeRow {
        topology: "3A:1F".into(),
        engine: "fused".into(),
        arm: "auto".into(),
        transport: "nvlink-ipc".into(),
        ranks_as: "threads".into(),
        ucx_tls: None,
        device_buffers: true,
        hidden: 2048,
        experts: 128,
        top_k: 8,
        capacity: 2048,
        payload: "bf16".into(),
        partials: "f32".into(),
        transport_sms: 24,
        tokens: vec![8, 8, 8],
        expert: "identity".into(),
        rounds: 20,
        warmup: 3,
        rejected_rounds: 0,
        timing: "device".into(),
        mode: mode.into(),
        start: "host".into(),
        round_us: 41.25,
        wall_us: 900.0,
        counts_us: 0.0,
        dispatch_us: phases,
        experts_us: 0.0,
        combine_us: phases,
        phases_us: None,
        load: None,
        status: "ok".into(),
        kernel_digest: "d".into(),
        pid: 7,
    }
}

/// Graph rows have no phase times (null in JSON, `–` in the table) and say their mode;
/// rows written before the mode existed read as eager.
#[test]
fn graph_rows_carry_their_mode_and_no_phases() {
    let g = row("graph", None);
    let v: serde_json::Value = serde_json::to_value(&g).unwrap();
    assert_eq!(v["mode"], "graph");
    assert!(
        v["dispatch_us"].is_null() && v["combine_us"].is_null(),
        "{v}"
    );
    let back: ExchangeRow = serde_json::from_value(v).unwrap();
    assert_eq!(back.dispatch_us, None);
    let t = table(&[g, row("eager", Some(12.5))]);
    assert!(
        t.contains("| 3A:1F | fused | auto | graph | f32 | nvlink-ipc | 8 | 41.2 | – | – |"),
        "{t}"
    );
    assert!(
        t.contains("| eager | f32 | nvlink-ipc | 8 | 41.2 | 12.5 | 12.5 |"),
        "{t}"
    );
    let mut old = serde_json::to_value(row("eager", Some(1.0))).unwrap();
    old.as_object_mut().unwrap().remove("mode");
    old.as_object_mut().unwrap().remove("partials");
    let old: ExchangeRow = serde_json::from_value(old).unwrap();
    assert_eq!(old.mode, "eager");
    assert_eq!(old.partials, "f32");
}

/// `--arm auto` is the rule in eager rounds (no forced arm) and every arm in one graph.
#[test]
fn the_auto_arm_is_the_rule() {
    assert_eq!(dispatch_arm(ArmArg::Auto), None);
    assert_eq!(round_arm(ArmArg::Auto), RoundArm::Auto);
    assert_eq!(
        round_arm(ArmArg::CountFirstSource),
        RoundArm::Fixed(DispatchArm::CountFirstSource)
    );
    assert!(EngineKind::Fused.arms().contains(&ArmArg::Auto));
    assert!(!EngineKind::Staged.arms().contains(&ArmArg::Auto));
}

#[test]
fn a_graph_run_takes_one_parameter_set() {
    let cfg = ExchangeConfig::new("1A:1F".parse().unwrap(), 16, 4, 2, 8).unwrap();
    let shape = |seed| {
        LayerParams::random(
            LayerShape {
                d_model: 16,
                width: 8,
                experts: 4,
                top_k: 2,
                shared: 0,
                renormalize: true,
            },
            seed,
        )
    };
    let prob = |params: Option<LayerParams>| Problem {
        cfg: cfg.clone(),
        inputs: Vec::new(),
        params,
    };
    let same = [prob(Some(shape(1))), prob(Some(shape(1)))];
    assert_eq!(rank_params(&same, true).unwrap(), Some(&shape(1)));
    let differ = [prob(Some(shape(1))), prob(Some(shape(2)))];
    let e = rank_params(&differ, true).unwrap_err().to_string();
    assert!(e.contains("--graph"), "{e}");
    // eager rounds take each problem's own experts
    assert_eq!(rank_params(&differ, false).unwrap(), Some(&shape(1)));
    assert_eq!(rank_params(&[prob(None), prob(None)], true).unwrap(), None);
    assert_eq!(rank_params(&[], true).unwrap(), None);
}

/// `afdep exchange --backend cuda --transport nvlink EXTRA..`'s arguments.
fn args(extra: &[&str]) -> Result<ExchangeArgs, clap::Error> {
    args_on("nvlink", extra)
}

/// `afdep exchange --backend cuda --transport TRANSPORT EXTRA..`'s arguments.
fn args_on(transport: &str, extra: &[&str]) -> Result<ExchangeArgs, clap::Error> {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: ExchangeArgs,
    }
    let mut v = vec!["afdep", "--backend", "cuda", "--transport", transport];
    v.extend_from_slice(extra);
    Cli::try_parse_from(v).map(|c| c.a)
}

/// `--load gemm` is 8192³; `gemm:M,N,K` any sizes the GEMM takes; anything else is refused
/// with the reason.
#[test]
fn load_specs_parse() {
    use super::load::LoadSpec;
    let d: LoadSpec = "gemm".parse().unwrap();
    assert_eq!((d.m, d.n, d.k), (8192, 8192, 8192));
    assert_eq!(d.label(), "gemm:8192,8192,8192");
    let s: LoadSpec = "gemm:100, 256,64".parse().unwrap();
    assert_eq!((s.m, s.n, s.k), (100, 256, 64));
    assert_eq!(s.flops(), 2.0 * 100.0 * 256.0 * 64.0);
    for (bad, why) in [
        ("conv", "the one load is gemm"),
        ("gemm:1,2", "three sizes"),
        ("gemm:1,8,8,8", "three sizes"),
        ("gemm:0,8,8", "positive"),
        ("gemm:8,12,8", "multiples of 8"),
        ("gemm:8,8,12", "multiples of 8"),
        ("gemm:a,8,8", "positive integers"),
        ("gemm:65536,65536,8", "2^31"),
    ] {
        let e = bad.parse::<LoadSpec>().unwrap_err();
        assert!(e.contains(why), "{bad}: {e}");
    }
    // through the command line
    let a = args(&["--graph", "--load", "gemm:512,512,512"]).unwrap();
    assert_eq!(a.load.map(|l| (l.m, l.n, l.k)), Some((512, 512, 512)));
    assert!(args(&["--graph", "--load", "gemm:512"]).is_err());
    assert_eq!(args(&["--graph"]).unwrap().load, None);
}

/// `check_graph` of `--backend cuda --transport nvlink EXTRA..`.
fn check(extra: &[&str]) -> Result<()> {
    check_graph(&args(extra).unwrap())
}

/// `flag` (its arguments) is refused without device rounds and with the ranks as processes;
/// with `accepted`, it also passes with `--graph` and with `--device-rounds`.
fn needs_device_rounds_on_threads(flag: &[&'static str], accepted: bool) {
    let with = |pre: &[&'static str]| [pre, flag].concat();
    if accepted {
        check(&with(&["--graph"])).unwrap();
        check(&with(&["--device-rounds"])).unwrap();
    }
    let e = check(flag).unwrap_err().to_string();
    assert!(e.contains("--graph or --device-rounds"), "{flag:?}: {e}");
    let e = check(&with(&["--graph", "--multi-process"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("threads only"), "{flag:?}: {e}");
}

/// `--load` needs device rounds, threads and no fault.
#[test]
fn load_needs_device_rounds_on_threads() {
    needs_device_rounds_on_threads(&["--load", "gemm"], true);
    let e = check(&["--graph", "--fault", "reject@0:1", "--load", "gemm"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("--fault"), "{e}");
}

/// Slowdown is loaded over alone, and nothing when either time is missing or not positive.
#[test]
fn slowdown_math() {
    use super::load::{slowdown, tflops};
    assert_eq!(slowdown(150.0, 100.0), Some(1.5));
    assert_eq!(slowdown(80.0, 100.0), Some(0.8));
    assert_eq!(slowdown(f64::NAN, 100.0), None);
    assert_eq!(slowdown(100.0, 0.0), None);
    assert_eq!(slowdown(-1.0, 100.0), None);
    // 2·8192³ flops in 2 ms: 549.8 TFLOP/s
    let t = tflops(2.0 * 8192f64.powi(3), 2000.0);
    assert!((t - 549.755).abs() < 0.01, "{t}");
    assert!(tflops(1.0, 0.0).is_nan());
}

fn times(round: &[f64]) -> Vec<RoundTimes> {
    round
        .iter()
        .map(|&r| RoundTimes {
            round: r,
            ..RoundTimes::default()
        })
        .collect()
}

fn rank_run(round: &[f64]) -> RankRun {
    RankRun {
        last: None,
        times: times(round),
        rejected: 0,
        traces: Vec::new(),
        probes: Vec::new(),
    }
}

/// The load row: rounds per pass as the slowest rank per round, medians, slowdowns; the GEMM
/// fields from the device that slowed down most; the duty of the rounds in the window.
#[test]
fn the_load_row_takes_medians_and_the_worst_device() {
    use super::load::{AloneGemm, LoadSpec, LoadedGemm, load_row};
    let spec: LoadSpec = "gemm:128,128,128".parse().unwrap();
    let l = LoadRuns {
        spec,
        // rank 1 is the slower in rounds 0 and 2: per round 12, 10, 14 → median 12
        alone: vec![rank_run(&[10.0, 10.0, 9.0]), rank_run(&[12.0, 8.0, 14.0])],
        gemm_alone: vec![
            AloneGemm {
                device: 0,
                launch_us: vec![100.0, 101.0, 99.0],
            },
            AloneGemm {
                device: 1,
                launch_us: vec![50.0, 50.0, 50.0],
            },
        ],
        gemm_loaded: vec![
            LoadedGemm {
                device: 0,
                launch_us: vec![110.0, 120.0, 130.0],
                window_us: 400.0,
                checked: 256,
            },
            LoadedGemm {
                device: 1,
                launch_us: vec![100.0, 100.0],
                window_us: 300.0,
                checked: 256,
            },
        ],
    };
    let r = load_row(&l, &times(&[18.0, 30.0, 24.0]));
    assert_eq!(r.load, "gemm:128,128,128");
    assert_eq!(r.devices, vec![0, 1]);
    assert_eq!((r.round_us_alone, r.round_us_loaded), (12.0, 24.0));
    assert_eq!(r.round_slowdown, Some(2.0));
    // device 1: 100 / 50 = 2× against device 0's 120 / 100
    assert_eq!((r.gemm_us_alone, r.gemm_us_loaded), (50.0, 100.0));
    assert_eq!(r.gemm_slowdown, Some(2.0));
    assert_eq!((r.gemm_launches_alone, r.gemm_launches_loaded), (3, 2));
    assert_eq!(r.window_us, 300.0);
    assert_eq!(r.round_duty, 72.0 / 300.0);
    assert_eq!(r.gemm_checked, 512);
    assert!((r.gemm_tflops_alone - spec.flops() / 50.0 * 1e-6).abs() < 1e-12);
    // in the row's JSON and table; rows without a load have no `load` key
    let mut g = row("graph", None);
    g.load = Some(r.clone());
    let v = serde_json::to_value(&g).unwrap();
    assert_eq!(v["load"]["round_slowdown"], 2.0);
    let back: ExchangeRow = serde_json::from_value(v).unwrap();
    assert_eq!(back.load, Some(r));
    let plain = serde_json::to_value(row("graph", None)).unwrap();
    assert!(plain.get("load").is_none(), "{plain}");
    let t = table(&[g, row("graph", None)]);
    assert!(
        t.contains("| 3A:1F | graph | auto | 2048 | 24 | 8 | gemm:128,128,128 | 12.0 | 24.0 | 2.00× | 50.0 | 100.0 | 2.00× |"),
        "{t}"
    );
    assert!(!table(&[row("graph", None)]).contains("GEMM"));
}

/// The host reference of the load's check accepts the exact product and refuses NaN (the
/// poisoned, unwritten output), zero and a neighbour's value.
#[test]
fn the_gemm_check_can_fail() {
    use super::load::{LoadError, LoadSpec, check_points, check_slice, operand};
    let spec: LoadSpec = "gemm:16,64,256".parse().unwrap();
    let exact = |r: usize, c: usize| -> f64 {
        (0..spec.k)
            .map(|k| {
                f64::from(operand(0x0a0a_0a0a, r * spec.k + k).to_f32())
                    * f64::from(operand(0x0b0b_0b0b, k * spec.n + c).to_f32())
            })
            .sum()
    };
    let (rows, cols) = check_points(&spec);
    assert_eq!(rows, vec![0, 5, 10, 15]);
    assert_eq!((cols.len(), cols[0], cols[cols.len() - 1]), (64, 0, 63));
    for &r in &rows {
        let good: Vec<bf16> = cols.iter().map(|&c| bf16::from_f64(exact(r, c))).collect();
        check_slice(&spec, 0, r, &cols, &good).unwrap();
    }
    let good: Vec<bf16> = cols.iter().map(|&c| bf16::from_f64(exact(5, c))).collect();
    for bad in [bf16::NAN, bf16::ZERO, bf16::from_f64(exact(6, cols[3]))] {
        let mut v = good.clone();
        v[3] = bad;
        // a value equal to the reference by chance would not be wrong
        if bad == good[3] {
            continue;
        }
        match check_slice(&spec, 2, 5, &cols, &v) {
            Err(LoadError::Mismatch {
                device: 2,
                row: 5,
                col,
                ..
            }) => assert_eq!(col, cols[3]),
            other => panic!("{other:?}"),
        }
    }
    // the operands are the same everywhere and in [-1, 1]
    assert_eq!(operand(1, 7), operand(1, 7));
    assert!(
        (0..1000)
            .map(|i| operand(3, i).to_f32())
            .all(|v| (-1.0..=1.0).contains(&v))
    );
}

/// `--pipeline M,..` parses a list, needs the fused engine over nvlink and refuses the other
/// modes and bad microbatch counts, each with its reason.
#[test]
fn pipeline_requests_are_checked() {
    let a = args(&["--pipeline", "1,2,4"]).unwrap();
    assert_eq!(a.pipeline.as_deref(), Some(&[1usize, 2, 4][..]));
    assert_eq!(args(&[]).unwrap().pipeline, None);
    let res = a.resolve().unwrap();
    super::pipeline::check(&a, &res, &[1, 2, 4]).unwrap();
    for (extra, why) in [
        (&["--graph"][..], "not with --graph"),
        (
            &["--device-rounds"][..],
            "not with --graph, --device-rounds",
        ),
        (&["--trace", "t.json"][..], "--trace"),
        (&["--multi-process"][..], "ranks as threads"),
    ] {
        let mut v = vec!["--pipeline", "2"];
        v.extend_from_slice(extra);
        let a = args(&v).unwrap();
        let e = super::pipeline::check(&a, &a.resolve().unwrap(), &[2])
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{extra:?}: {e}");
    }
    for bad in [&[0usize][..], &[1, 257][..], &[][..]] {
        assert!(super::pipeline::check(&a, &res, bad).is_err(), "{bad:?}");
    }
    // the staged engine cannot run it
    let mut staged = a.clone();
    staged.backend = crate::Backend::Cpu;
    let e = super::pipeline::check(&staged, &staged.resolve().unwrap(), &[2])
        .unwrap_err()
        .to_string();
    assert!(e.contains("fused engine"), "{e}");
}

/// `--backend cuda --transport nccl` is the NCCL device engine: payload-first, bf16, identity
/// experts, no `--load`, `--trace` or `--fault abort@..`; other transports name both engines.
#[test]
fn backend_cuda_over_nccl_is_the_nccl_device_engine() {
    let parse = |transport: &str, extra: &[&str]| args_on(transport, extra).unwrap();
    let a = parse("nccl", &["--expert", "identity"]);
    let res = a.resolve().unwrap();
    assert_eq!(res.engine, EngineKind::NcclDevice);
    assert_eq!(res.engine.name(), "nccl_device");
    assert_eq!(res.engine.arms(), &[ArmArg::PayloadFirst]);
    assert_eq!(res.engine.payloads(), &[afdep_core::PayloadKind::Bf16]);
    check_nccl_device(&a).unwrap();
    let e = check_nccl_device(&parse("nccl", &["--expert", "swiglu"])).unwrap_err();
    assert!(e.downcast_ref::<Unsupported>().is_some(), "{e}");
    for extra in [
        &["--expert", "identity", "--graph", "--load", "gemm"][..],
        &["--expert", "identity", "--graph", "--trace", "t.json"][..],
        &["--expert", "identity", "--fault", "abort@1:0"][..],
    ] {
        assert!(
            check_nccl_device(&parse("nccl", extra)).is_err(),
            "{extra:?}"
        );
    }
    // --graph with the NCCL device engine passes the device-round checks
    check_graph(&parse("nccl", &["--expert", "identity", "--graph"])).unwrap();
    let e = parse("tcp", &[]).resolve().unwrap_err().to_string();
    assert!(e.contains("--transport nccl"), "{e}");
}

/// `--partials bf16` (or `partials = "bf16"` in the config file, which the flag overrides)
/// reaches the exchange config, so the fingerprint and the rows carry it; the NCCL device engine,
/// which has f32 partials only, refuses it as unsupported (exit status 3), never ignores it.
#[test]
fn partials_reach_the_config_and_unsupported_engines_refuse_them() {
    use afdep_core::CombinePartials;
    let res = args(&[]).unwrap().resolve().unwrap();
    assert_eq!(res.cfg.partials, CombinePartials::F32);
    let res = args(&["--partials", "bf16"]).unwrap().resolve().unwrap();
    assert_eq!(res.cfg.partials, CombinePartials::Bf16);
    assert_eq!(res.engine, EngineKind::Fused);
    assert!(res.engine.partials().contains(&CombinePartials::Bf16));
    assert!(args(&["--partials", "f16"]).is_err());
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("x.toml");
    std::fs::write(&file, "partials = \"bf16\"\n").unwrap();
    let path = file.to_str().unwrap();
    let res = args(&["--config", path]).unwrap().resolve().unwrap();
    assert_eq!(res.cfg.partials, CombinePartials::Bf16);
    let res = args(&["--config", path, "--partials", "f32"])
        .unwrap()
        .resolve()
        .unwrap();
    assert_eq!(res.cfg.partials, CombinePartials::F32);
    std::fs::write(&file, "partials = \"f16\"\n").unwrap();
    assert!(args(&["--config", path]).unwrap().resolve().is_err());
    // the NCCL device engine
    let a = args_on("nccl", &["--expert", "identity", "--partials", "bf16"]).unwrap();
    let res = a.resolve().unwrap();
    assert_eq!(res.engine, EngineKind::NcclDevice);
    assert_eq!(res.engine.partials(), &[CombinePartials::F32]);
    let e = check_request(&a, &res).unwrap_err();
    let u = e.downcast_ref::<Unsupported>().expect("unsupported");
    assert_eq!(u.what, "bf16 combine partials");
}

/// `--probe` needs device rounds on threads and kernels built with probes (the variable's
/// value named when it is missing).
#[test]
fn probes_are_checked() {
    let probes =
        afdep_kernels::ops::probe::requested(&afdep_kernels::JitOptions::from_env().extra_options);
    needs_device_rounds_on_threads(&["--probe", "p.json"], probes);
    if !probes {
        let e = check(&["--graph", "--probe", "p.json"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("AFDEP_NVRTC_OPTIONS=-DAFDEP_PROBE"), "{e}");
    }
}

/// `--start-gate` needs device rounds on threads, no pipeline, and the fused engine: the NCCL
/// device engine refuses it as unsupported instead of running host-started rounds under a
/// `start: gate` label.
#[test]
fn the_start_gate_is_checked() {
    needs_device_rounds_on_threads(&["--start-gate"], true);
    let a = args_on("nccl", &["--expert", "identity", "--graph", "--start-gate"]).unwrap();
    let res = a.resolve().unwrap();
    assert_eq!(res.engine, EngineKind::NcclDevice);
    let e = check_request(&a, &res).unwrap_err();
    let u = e.downcast_ref::<Unsupported>().expect("unsupported");
    assert_eq!(u.what, "--start-gate");
    // a gated row says so in the table
    let mut r = row("graph", None);
    r.start = "gate".into();
    assert!(super::rows::table(&[r]).contains("| graph (gate start) |"));
}
