#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests that submit the real sbatch scripts
# (tests/ops/test_slurm_real_cluster.py) and for trying `lhd slurm render ... --var device=cpu` by hand.
#
#   bash scripts/local_slurm.sh start    # install slurm-wlm + munge (apt, as root), write the config, start, wait for idle
#   bash scripts/local_slurm.sh status   # daemons and `sinfo`
#   bash scripts/local_slurm.sh stop     # stop slurmd, slurmctld, munged (state and logs are kept)
#
# Idempotent: `start` on a running cluster only checks it; `stop` on a stopped one does nothing.
# A start after a stop begins with an empty queue (slurmctld -c): jobs left by an interrupted test
# session do not come back.
# No systemd: the daemons are started directly. The node is this host with its CPUs and memory,
# no GPUs (no GRES), proctrack/linuxproc (no cgroups needed), select/cons_tres with CR_CPU (memory
# is not a consumable, so a job's --mem only has to fit the node). Finished jobs stay visible:
# `sacct --completion` reads the job completion log (jobcomp/filetxt), and `scontrol show job`
# keeps them for an hour (MinJobAge). There is no slurmdbd, so plain `sacct` does not work here.
#
# Files: /etc/slurm/slurm.conf (refused if one exists that this script did not write),
# state under $LHD_SLURM_STATE (default /var/lib/lhd-slurm), logs under $LHD_SLURM_STATE/log.
set -euo pipefail

STATE="${LHD_SLURM_STATE:-/var/lib/lhd-slurm}"
CONF=/etc/slurm/slurm.conf
MARK="# written by lhd scripts/local_slurm.sh"
LOG="$STATE/log"
NODE="$(hostname -s)"

die() { echo "local_slurm: error: $*" >&2; exit 1; }
say() { echo "local_slurm: $*" >&2; }

need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root (apt-get install slurm-wlm munge, daemons on ports 6817/6818); run as root"
}

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get to install them"
  say "installing slurm-wlm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed (no network or no package mirror?)"
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
    || die "apt-get install slurm-wlm munge failed"
  command -v slurmctld >/dev/null || die "slurm-wlm installed but slurmctld is not on PATH"
}

write_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; refusing to overwrite a real cluster's config"
  fi
  local cpus mem_mb
  cpus="$(nproc --all)"
  mem_mb="$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)"
  mem_mb=$(( mem_mb > 1024 ? mem_mb - 512 : mem_mb ))  # leave the OS a little
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$LOG"
  cat > "$CONF.new" <<EOF
$MARK; rewritten on every start
ClusterName=lhd-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.log
MinJobAge=3600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
Waittime=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  mv "$CONF.new" "$CONF"
}

running() {  # running NAME PIDFILE
  local pid
  [ -f "$2" ] || return 1
  pid="$(cat "$2" 2>/dev/null || true)"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$1" ]
}

start_munge() {
  local pidfile=/run/munge/munged.pid
  if running munged "$pidfile"; then return 0; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then mungekey --create --force; else
      dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock "$pidfile"
  runuser -u munge -- /usr/sbin/munged --pid-file="$pidfile" \
    || die "munged did not start (see /var/log/munge/munged.log)"
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.1; done
  die "munged started but \`munge -n\` fails (see /var/log/munge/munged.log)"
}

wait_idle() {
  local state=""
  for _ in $(seq 120); do
    state="$(sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n 1 || true)"
    case "$state" in
      idle|mixed|allocated) return 0 ;;
      down*|drain*|fail*)  # a node left down by an earlier run: bring it back
        scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node $NODE is '${state:-not listed}' after 60 s, not idle (see $LOG/slurmctld.log and $LOG/slurmd.log)"
}

start() {
  need_root
  install
  if running slurmctld "$STATE/slurmctld.pid" && running slurmd "$STATE/slurmd.pid"; then
    wait_idle
    say "already running; node $NODE is $(sinfo -h -N -n "$NODE" -o %T)"
    return 0
  fi
  stop_daemons quiet
  write_conf
  start_munge
  /usr/sbin/slurmctld -c || die "slurmctld did not start (see $LOG/slurmctld.log)"
  for _ in $(seq 50); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
  scontrol ping >/dev/null 2>&1 || die "slurmctld does not answer \`scontrol ping\` (see $LOG/slurmctld.log)"
  /usr/sbin/slurmd || die "slurmd did not start (see $LOG/slurmd.log; \`slurmd -C\` shows what it detects)"
  wait_idle
  say "up: node $NODE ($(nproc --all) CPUs), partition debug; $(sinfo -h -o '%P %a %D %T' | head -n 1)"
}

stop_one() {  # stop_one NAME PIDFILE
  local pid
  running "$1" "$2" || { rm -f "$2"; return 0; }
  pid="$(cat "$2")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { rm -f "$2"; return 0; }; sleep 0.1; done
  say "$1 ($pid) did not stop in 10 s; sending SIGKILL"
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$2"
}

stop_daemons() {
  stop_one slurmd "$STATE/slurmd.pid"
  stop_one slurmctld "$STATE/slurmctld.pid"
  stop_one munged /run/munge/munged.pid
  [ "${1:-}" = quiet ] || say "stopped"
}

status() {
  local rc=0 name pidfile
  for pair in "munged:/run/munge/munged.pid" "slurmctld:$STATE/slurmctld.pid" "slurmd:$STATE/slurmd.pid"; do
    name="${pair%%:*}"; pidfile="${pair#*:}"
    if running "$name" "$pidfile"; then echo "$name: running (pid $(cat "$pidfile"))"; else echo "$name: stopped"; rc=1; fi
  done
  [ "$rc" -eq 0 ] && sinfo
  return "$rc"
}

case "${1:-}" in
  start) start ;;
  stop) need_root; stop_daemons ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
