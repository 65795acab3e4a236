"""The recipes' logging: our warnings and third-party errors on the terminal, the rest in the
per-rank log file, and a library's later ``logging.basicConfig`` changes nothing."""

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.slow
def test_console_stays_plain_and_the_log_file_keeps_everything(tmp_path):
    log_file = tmp_path / "logs" / "rank3.log"
    script = textwrap.dedent(f"""
        import logging, sys, warnings
        from mcore_refit.logs import configure_logging
        configure_logging(rank=3, log_file={str(log_file)!r})
        # What megatron.training does when imported:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        logging.getLogger("megatron.core.x").info("third-party chatter")
        logging.getLogger("megatron.core.x").warning("third-party warning")
        logging.getLogger("megatron.core.x").error("third-party error")
        warnings.warn("a python warning")
        logging.getLogger("mcore_refit.grpo.loop").info("refit {{}}")
        logging.getLogger("mcore_refit.grpo.loop").warning("our warning")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    terminal = [line.split(": ", 1)[1] for line in result.stderr.splitlines()]
    assert terminal == ["third-party error", "our warning"]
    logged = [line.split(": ", 1)[1] for line in log_file.read_text().splitlines()
              if " rank3 " in line]
    assert logged[:3] == ["third-party chatter", "third-party warning", "third-party error"]
    assert "a python warning" in logged[3]
    assert logged[4:] == ["refit {}", "our warning"]


@pytest.mark.slow
def test_library_handlers_and_printed_output_go_to_the_log_file(tmp_path):
    # torch and transformers log through stderr handlers of their own (propagation off); a
    # library may print, or attach a stderr handler while it is imported (Megatron-Bridge).
    log_file = tmp_path / "rank0.log"
    script = textwrap.dedent(f"""
        import logging, sys
        import torch
        from mcore_refit.logs import configure_logging, output_to_log
        configure_logging(rank=0, log_file={str(log_file)!r})
        logging.getLogger("torch.utils.cpp_extension").warning("torch warning")
        import transformers.utils.logging as hf
        hf.get_logger("transformers.configuration_utils").warning("transformers warning")
        with output_to_log("a library"):
            print("printed to stdout")
            library = logging.getLogger("a.library")
            library.addHandler(logging.StreamHandler())
            library.info("logged to its own handler")
        library.error("a library error")
        print("our own print")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "our own print\n"
    assert [line.split(": ", 1)[1] for line in result.stderr.splitlines()] == ["a library error"]
    logged = log_file.read_text()
    for text in ("torch warning", "transformers warning", "a library printed:\nprinted to "
                 "stdout\nlogged to its own handler", "logged to its own handler",
                 "a library error"):
        assert text in logged, text
