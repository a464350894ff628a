#!/usr/bin/env bash
# Session 24, for the next session (not run here): issue 17's whole check in one run on one host: call A without its
# thread-pool A/B (measured: no setting beat 16 bound workers), on the code of the day (this session's fixes: the
# profile's synthetic stage in 3 rounds, each bench row's session freed before the next, the CPU overhead by bytes).
# Carry and poll as callA.sh says (RUN_OUT=/tmp/callD; two calls, ~11 minutes).
THREADS_AB=0 exec bash "$(dirname "${BASH_SOURCE[0]}")/callA.sh"
