"""Engine: one training job over a backend's Engine (lorakit.backends): the job (job.py, session.py), the loop
(loop.py) and its loss (loss.py), objectives, checkpoints and resume, saving, the summary, process groups
and launch (launch.py, dist.py, mesh.py)."""
