#!/usr/bin/env bash
# make test: the whole suite in two streams side by side.
#
# * the node's tests (marked `node`: the machine has one node, so they run one after
#   another), in the background, their output kept in a file and shown when they end;
# * every other test on two pytest workers (pytest-xdist, each module on one worker, so
#   a module's API server starts once).
#
# The node tests mostly wait on the kubelet and containerd, the others on their API
# servers, so the two streams share the 2 cores well (one after the other took 23 min).
# Exit status: the first failing stream's, or 0. (xdist's loadgroup cannot keep the
# node tests on one worker with pytest 9: the group never reaches the test ids.)
set -uo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
node_log="$(mktemp -t epguard-node-tests.XXXXXX.log)"
start=$SECONDS
"$py" -m pytest -p no:cacheprovider -m node --durations=15 >"$node_log" 2>&1 &
node_pid=$!
"$py" -m pytest -n 2 --dist loadscope -m "not node" --durations=15
rest=$?
echo "== make test: every test but the node's ended ($rest) after $((SECONDS - start)) s; waiting for the node's"
wait "$node_pid"
node=$?
echo "== make test: the node's tests (marked node), output kept in $node_log:"
cat "$node_log"
echo "== make test: node tests $node, the others $rest; $((SECONDS - start)) s in all"
[ "$rest" -ne 0 ] && exit "$rest"
exit "$node"
