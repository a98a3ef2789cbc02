# The frame both environment builders share (sourced by scripts/install_inspect.sh and
# scripts/install_vllm_cpu.sh): one line on failure, also written to <venv>.failed (the tests print
# it as their skip reason), one build at a time, and a stamp that marks a finished environment.
# The sourcing script sets NAME (its message prefix) and VENV before sourcing.
FAILED="$VENV.failed"
LOG="$VENV.install.log"
STAMP="$VENV/lhd-$NAME"

fail() {
    echo "$NAME: FAILED: $1" >&2
    printf '%s\n' "$1" > "$FAILED"
    exit 1
}

last_error() { grep -E '^(ERROR|error):' "$LOG" | tail -n 1 | cut -c1-300; }

# Only one build at a time (two `make test` in one checkout would otherwise race in one venv).
lock_venv() {
    mkdir -p "$(dirname "$VENV")" || { echo "$NAME: FAILED: cannot create $(dirname "$VENV")" >&2; exit 1; }
    exec 9> "$VENV.lock"
    flock 9 || fail "cannot lock $VENV.lock"
}

# Exit 0 when the environment with executable $1 was already built as $WANT; else start the log.
skip_if_built() {
    if [[ -x "$1" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
        rm -f "$FAILED"
        echo "$NAME: ok (already built): $1 ($WANT)"
        exit 0
    fi
}

start_log() {
    echo "$NAME: building $VENV ($WANT); log: $LOG"
    : > "$LOG"
}

mark_built() {
    printf '%s' "$WANT" > "$STAMP"
    rm -f "$FAILED"
}
