"""Training: features and crops of protein chains, the distogram model, the loop of `tpf train`."""
