"""`ckpt doctor`: a prime-rl run's config and disk traps, found before they cost hours. `run` gathers
the facts (`facts`) and runs the traps (`traps`, one small function per trap in `traps_config` and
`traps_run`, over plain facts)."""
from .run import EXIT_CLEAN, EXIT_PROBLEMS, DoctorOptions, DoctorPlan, DoctorReport, doctor, plan_doctor, run_doctor

__all__ = ["EXIT_CLEAN", "EXIT_PROBLEMS", "DoctorOptions", "DoctorPlan", "DoctorReport", "doctor", "plan_doctor",
           "run_doctor"]
