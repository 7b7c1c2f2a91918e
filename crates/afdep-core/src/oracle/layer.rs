//! The MoE layer oracle (forward and train step). Placeholder until written.
