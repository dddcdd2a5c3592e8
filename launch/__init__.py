"""Launching on clusters, installed as ``mcore_rl.launch``.

- `sbatch`: the one sbatch template (``templates/sbatch.sh``), its renderer and submitter;
- `stop_signal`: how all ranks agree to stop, checkpoint and requeue on preemption;
- `preflight`: the start-up collective that names a broken node and rank;
- `slurm_cluster`: a real two-node SLURM cluster on one machine, for tests and trials.
"""
