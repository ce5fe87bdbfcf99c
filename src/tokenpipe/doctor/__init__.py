"""Explains where one request's latency goes: network phases, server phases, stalls,
chunking, head-of-line blocking, and latency against output length.

    import asyncio
    from tokenpipe.doctor import DoctorOptions, diagnose

    report = asyncio.run(diagnose(DoctorOptions("http://127.0.0.1:8000/v1", "sim-model")))
    print(report.to_json()["phases_ms"], [f.kind for f in report.findings])
"""

from tokenpipe.doctor.findings import KINDS, Finding, Thresholds
from tokenpipe.doctor.fit import LinearFit, ScalingCheck, check_scaling, linear_fit
from tokenpipe.doctor.run import DoctorOptions, DoctorReport, diagnose

__all__ = [
    "KINDS",
    "DoctorOptions",
    "DoctorReport",
    "Finding",
    "LinearFit",
    "ScalingCheck",
    "Thresholds",
    "check_scaling",
    "diagnose",
    "linear_fit",
]
