//! Unit tests of `afdep exchange`.

use super::*;
use super::{args::*, problem::*, ranks::*, rows::*};
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
        transport_sms: 24,
        tokens: vec![8, 8, 8],
        expert: "identity".into(),
        rounds: 20,
        warmup: 3,
        rejected_rounds: 0,
        timing: "device".into(),
        mode: mode.into(),
        round_us: 41.25,
        wall_us: 900.0,
        counts_us: 0.0,
        dispatch_us: phases,
        experts_us: 0.0,
        combine_us: phases,
        phases_us: None,
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
        t.contains("| 3A:1F | fused | auto | graph | nvlink-ipc | 8 | 41.2 | – | – |"),
        "{t}"
    );
    assert!(
        t.contains("| eager | nvlink-ipc | 8 | 41.2 | 12.5 | 12.5 |"),
        "{t}"
    );
    let mut old = serde_json::to_value(row("eager", Some(1.0))).unwrap();
    old.as_object_mut().unwrap().remove("mode");
    let old: ExchangeRow = serde_json::from_value(old).unwrap();
    assert_eq!(old.mode, "eager");
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
