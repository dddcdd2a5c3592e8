"""Launching on clusters, installed as ``mcore_rl.launch``.

- `sbatch`: the sbatch template (``templates/sbatch_ray.sh``: Ray on every node, then the
  driver, ``mcore-rl train`` or a script), its renderer and submitter;
- `ray_node`: one node's Ray of a job (own temp dir and ports), started and stopped;
- `stop_signal`: how all ranks agree to stop, checkpoint and requeue on preemption;
- `preflight`: the start-up collective that names a broken node and rank;
- `slurm_cluster`: a real two-node SLURM cluster on one machine, for tests and trials.
"""
