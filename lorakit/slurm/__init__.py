"""python -m lorakit.slurm RECIPE [KEY=VALUE ...] --nodes N --gpus-per-node G [--submit]: a Slurm job for a
recipe, written as a readable sbatch script (`job.sbatch` in output.dir) that checks the nodes first (the
multi-node preflight of lorakit.doctor), starts one launcher per node (lorakit.slurm.node), and requeues
itself when preempted, the requeued job resuming in the same run directory. See docs/multinode.md#slurm.
"""
