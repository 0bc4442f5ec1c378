"""Vendor conformance runner (``calexec conform``, spec §14).

Runs experiments against any library implementing ``calrt.h`` and answers each §14 question
with proven / disproven / inconclusive plus the raw evidence: ``runner`` (CLI and ``run``),
``experiments`` (the measurements), ``isolate`` (child process with timeout),
``experiment_rig`` (device, buffers, oracle helpers), ``verdict`` (the answer type),
``report`` (settings, Markdown/JSON) and ``overlap_trace`` (Perfetto trace and PNG timing
diagram of the overlap experiment).
"""
