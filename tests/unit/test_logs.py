"""The recipes' logging: our warnings and third-party errors on the terminal, the rest in the
per-rank log file, and a library's later ``logging.basicConfig`` changes nothing."""

import subprocess
import sys
import textwrap


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
