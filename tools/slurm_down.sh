#!/bin/bash
# slurm_down.sh - stop what tools/slurm_up.sh started, by PID only: the daemons' pid files, and
# with NETNS=<name> whatever is left inside that private network namespace (job steps, Ray),
# which then is deleted.  Never by name.  --purge also removes state, logs, config, wrappers.
#   MRL_SLURM_DIR=/tmp/mrl-slurm NETNS=mrlslurm tools/slurm_down.sh [--purge]
D=${MRL_SLURM_DIR:?set MRL_SLURM_DIR}; S=$D/slurm; M=$D/munge; NETNS=${NETNS:-}
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
export PATH=$D/bin:$PATH SLURM_CONF=$S/slurm.conf
# 1. cancel the jobs and give slurmstepd time to end their processes
if [ -f "$SLURM_CONF" ] && alive "$S/run/slurmctld.pid"; then
  scancel --state=RUNNING,PENDING,SUSPENDED 2>/dev/null
  for _ in $(seq 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
fi
# 2. the daemons, by pid file
pids=""
for f in "$S"/run/slurmd-*.pid "$S/run/slurmctld.pid" "$M/munged.pid"; do
  alive "$f" && { pids="$pids $(cat "$f")"; kill "$(cat "$f")"; }
done
for p in $pids; do for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done; done
for p in $pids; do kill -0 "$p" 2>/dev/null && { echo "pid $p still alive: SIGKILL"; kill -9 "$p"; }; done
rm -f "$S"/run/*.pid
# 3. leftovers inside our private netns (only what runs there is ours)
if [ -n "$NETNS" ] && ip netns list | grep -qw "^$NETNS"; then
  left=$(ip netns pids "$NETNS")
  [ -n "$left" ] && { echo "netns $NETNS leftovers: $left"; kill $left 2>/dev/null; sleep 3; }
  left=$(ip netns pids "$NETNS"); [ -n "$left" ] && kill -9 $left 2>/dev/null
  sleep 0.5; ip netns del "$NETNS" && echo "netns $NETNS deleted"
fi
if [ "${1:-}" = --purge ]; then
  rm -rf "$S/state" "$S/spool" "$S/log" "$S/run" "$S/slurm.conf" "$S/hosts" "$M" "$D/bin"
fi
echo "slurm down (stopped:${pids:- none})"
