"""Host-side native helpers that are not CalRT: C code built by cffi at install
(drivers/native_build.py), run by calexec's own threads whichever CalRT is loaded.

Today one: the fused logits postprocess (``fused_logits.FusedLogits`` over
``calexec_bf16_logits`` in ``calexec_native.c``). This package imports nothing of calexec but its
own compiled module; the CalRT driver hands a ``FusedLogits`` to the executor
(``CalRT.logits_postprocessor()``), since machines/ imports no cffi.
"""
