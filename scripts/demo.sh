#!/usr/bin/env bash
# `make demo`: epguard end to end on a real one-node cluster (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kube-proxy, a kubelet on containerd + runc;
# see docs/devcluster.md), with the chart helm-installed as an admin would (webhook and
# controller as pods), as a terminal session:
#
#   1. a deny rule added the way an admin does (helm values, `rules.extra`);
#   2. an elastic-EP pod on a known-bad image refused at `kubectl apply`, with the reason;
#   3. an ordinary pod admitted and Running;
#   4. a Deployment on the bad image refused at apply;
#   5. a Deployment of 4 workers on a real worker image (SGLang 0.5.23, torch 2.13.0+cu130,
#      the CUDA 12 mooncake-transfer-engine 0.3.13.post1) that nobody has judged, in a
#      namespace opted in to injection: every replica is held unscheduled by the
#      preflight gate while one preflight pod runs the probe in that image under the real
#      kubelet; its cause keeps all 4 unscheduled (`kubectl describe` says why, on the pods
#      and the Deployment), and nothing of the model is mounted: its 1 GiB image volume,
#      in the node's own OCI registry, is never pulled (the registry's access log);
#   6. the loop: the controller turns that into an ImageVerdict keyed by the digest
#      containerd reports, and the next pod on the same image is refused at apply;
#   7. a worker on an image whose files prove nothing: the gate comes off, the kubelet
#      pulls the model image (now the registry serves it), and the probe injected first
#      runs on the node, finds the node's cause (no GPU driver), the pod
#      stops in Init:Error before the model download, and nothing is learned.
#
# Every step checks that what it shows really happened; the script exits non-zero
# otherwise. Everything it started is stopped on exit (also on failure or Ctrl-C).
#
# Environment: EPGUARD_CACHE (default ~/.cache/epguard; kubectl, helm, kube-apiserver,
# etcd in its bin/), EPGUARD_DEMO_KEEP=1 (leave the stack running; stop it with
# `.venv/bin/python -m devcluster --run-dir <dir> down`).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$REPO/.venv/bin/python"
export EPGUARD_CACHE="${EPGUARD_CACHE:-$HOME/.cache/epguard}"
export PATH="$EPGUARD_CACHE/bin:$PATH"
# Our own run directory, so that a `make up` stack next to it is left alone.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/epguard-demo.XXXXXX")"
RUN_DIR="$WORK/run"
STARTED=0

if [[ -t 1 ]]; then
  BOLD=$'\e[1m' DIM=$'\e[2m' RED=$'\e[31m' GREEN=$'\e[32m' OFF=$'\e[0m'
else
  BOLD='' DIM='' RED='' GREEN='' OFF=''
fi

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ $STARTED == 1 && "${EPGUARD_DEMO_KEEP:-0}" == 1 ]]; then
    echo "${DIM}# left running; stop with: $PY -m devcluster --run-dir $RUN_DIR down${OFF}"
  elif [[ $STARTED == 1 ]]; then
    echo
    echo "${DIM}# cleaning up${OFF}"
    (cd "$REPO" && "$PY" -m devcluster --run-dir "$RUN_DIR" down) || rc=1
    rm -rf "$WORK"
  else
    rm -rf "$WORK"
  fi
  if [[ $rc == 0 ]]; then
    echo "${GREEN}${BOLD}demo: every step behaved as shown${OFF}"
  else
    echo "${RED}${BOLD}demo FAILED (exit $rc)${OFF}" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# say LINE...: a comment block, one "# LINE" per argument.
say() {
  echo
  local line
  for line in "$@"; do printf '%s# %s%s\n' "$BOLD" "$line" "$OFF"; done
}
fail() { printf '%sdemo step failed: %s%s\n' "$RED" "$*" "$OFF" >&2; exit 1; }

# run CMD...: echo it like a prompt, run it, print what it printed; OUT and RC hold the
# combined output and exit status.
OUT='' RC=0
run() {
  printf '%s$ %s%s\n' "$BOLD" "$*" "$OFF"
  set +e
  OUT="$("$@" 2>&1)"
  RC=$?
  set -e
  [[ -z "$OUT" ]] || printf '%s\n' "$OUT"
}
expect_ok() { [[ $RC == 0 ]] || fail "expected success, got exit $RC"; }
expect_refused() { [[ $RC != 0 ]] || fail "expected a refusal, but it was admitted"; }
expect_text() { [[ "$OUT" == *"$1"* ]] || fail "expected the output to contain: $1"; }
expect_re() { grep -Eq -- "$1" <<<"$OUT" || fail "expected the output to match: $1"; }
expect_no_text() { [[ "$OUT" != *"$1"* ]] || fail "expected the output not to contain: $1"; }

# Poll (quietly) until CMD succeeds; for things a controller or a watch does shortly.
wait_for() {
  local what="$1" tries="$2"
  shift 2
  for ((i = 0; i < tries; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  fail "gave up waiting for $what"
}

cd "$WORK"
BAD_IMAGE="registry.example.com/ml/sglang:0.5.22-mte0.3.13"
# Built by `make tools` (devcluster/images.py); the kubelet pulls it from the node's registry.
PROBED_IMAGE="$(cd "$REPO" && "$PY" -c 'from devcluster.images import BAD_WORKER; print(BAD_WORKER.ref)')"
BUSYBOX_IMAGE="$(cd "$REPO" && "$PY" -c 'from devcluster.images import BUSYBOX_IMAGE; print(BUSYBOX_IMAGE)')"

# --- 0. the control plane, with epguard and one admin rule ------------------------------
cat >values.yaml <<'EOF'
rules:
  extra:
    - id: ml-sglang-0522-mte-0313
      image: "registry.example.com/ml/sglang:0.5.22-*"
      reason: >-
        torch 2.14.1 with mooncake-transfer-engine 0.3.13.post1, which ships no pg_2_14_1
        extension ("Mooncake PG was not built against torch==2.14.1")
      remedy: >-
        rebuild on SGLang 0.5.18-0.5.21 (torch 2.13.0) with
        mooncake-transfer-engine-cuda13==0.3.13.post1
      action: deny
EOF
say "An admin's rule for images built in-house, added with helm values (rules.extra):"
run cat values.yaml

say "Bring up a one-node cluster and helm-install charts/epguard (webhook and controller as pods):"
STARTED=1
printf '%s$ python -m devcluster up --helm-arg=--values=values.yaml%s\n' "$BOLD" "$OFF"
if ! UP="$(cd "$REPO" && "$PY" -m devcluster --run-dir "$RUN_DIR" up \
  --helm-arg="--values=$WORK/values.yaml")"; then
  fail "devcluster up failed (logs in $RUN_DIR/logs)"
fi
eval "${UP##*$'\n'}" # the last line: export KUBECONFIG=...
[[ -n "${KUBECONFIG:-}" && -f "$KUBECONFIG" ]] || fail "devcluster up printed no kubeconfig"
echo "${DIM}export KUBECONFIG=$KUBECONFIG${OFF}"

run kubectl get nodes
expect_text " Ready "
run kubectl get pods -n epguard-system
expect_re "epguard-webhook-.* 1/1 +Running"
expect_re "epguard-controller-.* 1/1 +Running"
run kubectl get validatingwebhookconfigurations
expect_ok
run kubectl create namespace ml
expect_ok

# --- 1. a known-bad image refused ---------------------------------------------------------
cat >sglang-bad.yaml <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: sglang-bad
  namespace: ml
spec:
  containers:
    - name: worker
      image: $BAD_IMAGE
      command: ["python3", "-m", "sglang.launch_server"]
      args: ["--model-path", "/models/qwen3-30b-a3b", "--tp", "8", "--ep", "8",
             "--elastic-ep-backend", "mooncake"]
EOF
say "An SGLang worker asking for mooncake elastic EP on an image the rule names:"
run cat sglang-bad.yaml
run kubectl apply -f sglang-bad.yaml
expect_refused
# The outage backstop (a ValidatingAdmissionPolicy) is evaluated by the API server before
# any webhook, so for a rule-denied image it answers first, with the webhook's message.
expect_re 'admission webhook "pods.epguard.io" denied the request|ValidatingAdmissionPolicy .epguard-backstop. with binding .epguard-backstop-enforce. .*denied request: epguard \(backstop policy\)'
expect_text "Mooncake PG was not built against torch==2.14.1"
expect_text "[epguard rule ml-sglang-0522-mte-0313]"
run kubectl get pods -n ml
expect_no_text "sglang-bad"

# --- 2. an ordinary pod admitted ----------------------------------------------------------
cat >web.yaml <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: ml
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: web
      image: $BUSYBOX_IMAGE
      imagePullPolicy: IfNotPresent
      command: ["httpd", "-f", "-p", "8080"]
EOF
say "An ordinary pod (it never even reaches epguard: the webhook's matchConditions skip it):"
run kubectl apply -f web.yaml
expect_ok
expect_text "pod/web created"
expect_no_text "epguard"
wait_for "the ordinary pod to run" 120 \
  bash -c "kubectl get pod web -n ml -o jsonpath='{.status.phase}' | grep -q Running"
run kubectl get pod web -n ml
expect_re "web +1/1 +Running"

# --- 3. a Deployment refused at apply -----------------------------------------------------
cat >deployment.yaml <<EOF
apiVersion: apps/v1
kind: Deployment
metadata:
  name: sglang-decode
  namespace: ml
spec:
  replicas: 4
  selector:
    matchLabels: {app: sglang-decode}
  template:
    metadata:
      labels: {app: sglang-decode}
    spec:
      containers:
        - name: worker
          image: $BAD_IMAGE
          command: ["python3", "-m", "sglang.launch_server"]
          args: ["--model-path", "/models/qwen3-30b-a3b", "--elastic-ep-backend=mooncake"]
          resources:
            limits: {nvidia.com/gpu: 8}
EOF
say "The same image in a Deployment is refused at apply, not four crash-looping pods later:"
run kubectl apply -f deployment.yaml
expect_refused
expect_re 'admission webhook "workloads.epguard.io" denied the request|ValidatingAdmissionPolicy .epguard-backstop. with binding .epguard-backstop-enforce. .*denied request: epguard \(backstop policy\)'
expect_text 'container "worker"'
run kubectl get deployments -n ml
expect_no_text "sglang-decode"

# --- 4. the preflight gate: workers on an image nobody has judged ------------------------
MODELS="$WORK/models"  # the hostPath the model download would write to
# The weights as an OCI image volume in the node's registry (devcluster/registry.py),
# removed from containerd's store first so that any pull shows in the registry's log.
eval "$(cd "$REPO" && "$PY" -m devcluster --run-dir "$RUN_DIR" model --forget)"
[[ "$MODEL_SERVED" == 0 ]] || fail "the registry served the model before the demo: $MODEL_SERVED"
POD_SPEC=$(cat <<EOF
  terminationGracePeriodSeconds: 1
  volumes:
    - name: models
      hostPath: {path: $MODELS, type: DirectoryOrCreate}
    - name: weights
      image: {reference: $MODEL_REF, pullPolicy: IfNotPresent}
  initContainers:
    - name: model-download
      image: $BUSYBOX_IMAGE
      imagePullPolicy: IfNotPresent
      command: ["sh", "-c", "echo downloading > /models/started"]
      volumeMounts: [{name: models, mountPath: /models}]
  containers:
    - name: worker
      image: IMAGE
      imagePullPolicy: IfNotPresent
      command: ["python3", "-m", "sglang.launch_server"]
      args: ["--model-path", "/models/qwen3-30b-a3b", "--elastic-ep-backend", "mooncake"]
      resources:
        limits: {nvidia.com/gpu: 8}
      volumeMounts:
        - {name: models, mountPath: /models}
        - {name: weights, mountPath: /weights, readOnly: true}
EOF
)
cat >sglang.yaml <<EOF
apiVersion: apps/v1
kind: Deployment
metadata:
  name: sglang
  namespace: ml
spec:
  replicas: 4
  selector:
    matchLabels: {app: sglang}
  template:
    metadata:
      labels: {app: sglang}
    spec:
$(sed -e 's/^/    /' -e "s|image: IMAGE|image: $PROBED_IMAGE|" <<<"$POD_SPEC")
EOF
pod_yaml() { # NAME IMAGE [RESTART_POLICY]
  printf 'apiVersion: v1\nkind: Pod\nmetadata:\n  name: %s\n  namespace: ml\nspec:\n' "$1"
  [[ -z "${3:-}" ]] || printf '  restartPolicy: %s\n' "$3"
  sed -e "s|image: IMAGE|image: $2|" <<<"$POD_SPEC"
}
pod_yaml sglang-1 "$PROBED_IMAGE" >sglang-1.yaml

say "Opt the namespace in to probe injection (the mutating webhook adds the probe to worker pods):"
run kubectl label namespace ml epguard.io/inject=enabled
expect_ok
# The webhook reads namespace labels from a watch; wait until a dry run shows the probe.
wait_for "the webhook to see the namespace label" 60 \
  bash -c "kubectl create --dry-run=server -f sglang-1.yaml -o jsonpath='{.spec.initContainers[*].name}' | grep -q epguard-probe"

say "4 workers on a real image no rule knows (SGLang 0.5.23, torch 2.13.0+cu130, the CUDA 12" \
  "mooncake-transfer-engine 0.3.13.post1). Their 1 GiB model is an image volume, which the" \
  "kubelet pulls before any init container runs; so each pod is admitted" \
  "with the probe injected and held unscheduled (scheduling gate epguard.io/preflight)" \
  "while one preflight pod judges the image's files (docs/preflight.md):"
run cat sglang.yaml
APPLIED=$(date +%s.%N)
run kubectl apply -f sglang.yaml
expect_ok
wait_for "the ReplicaSet's 4 pods" 120 \
  bash -c '[[ $(kubectl get pods -n ml -l app=sglang -o name | wc -l) == 4 ]]'
run kubectl get pods -n ml -l app=sglang -o \
  "jsonpath={range .items[*]}{.metadata.name}{'  gates='}{.spec.schedulingGates[*].name}{'\n'}{end}"
[[ $(grep -c "gates=epguard.io/preflight" <<<"$OUT") == 4 ]] || fail "not every replica is gated"

wait_for "the preflight's answer on every replica" 960 \
  bash -c "[[ \$(kubectl get pods -n ml -l app=sglang -o jsonpath='{range .items[*]}{.status.conditions[?(@.type==\"epguard.io/Preflight\")].reason}{\"\n\"}{end}' | grep -c ImageUnusable) == 4 ]]"
printf '%s# apply -> every replica held with the cause the probe found: %.1fs%s\n' "$DIM" \
  "$(echo "$(date +%s.%N) - $APPLIED" | bc)" "$OFF"
run kubectl get pods -n ml
[[ $(grep -c "SchedulingGated" <<<"$OUT") == 4 ]] || fail "expected 4 SchedulingGated replicas"
PREFLIGHT="$(kubectl get pods -n ml -l epguard.io/preflight-pod=true -o name)"
[[ -n "$PREFLIGHT" && $(wc -l <<<"$PREFLIGHT") == 1 ]] || fail "expected one preflight: $PREFLIGHT"

say "One preflight for the 4 replicas. The message below was written by the real probe in the" \
  "real image, under the real kubelet, on a node the worker could run on, with no GPU:"
run kubectl describe -n ml "$PREFLIGHT"
expect_re "Message: +epguard: mooncake elastic EP is unusable in this image"
expect_text "libcudart.so.12"
expect_re "Exit Code: +1"

say "Every replica stays unscheduled and says why, and so does the Deployment:"
POD="$(kubectl get pods -n ml -l app=sglang -o jsonpath='{.items[0].metadata.name}')"
wait_for "the Event on the Deployment" 60 \
  bash -c "kubectl get events -n ml --field-selector involvedObject.kind=Deployment,reason=ImageUnusable -o name | grep -q ."
run kubectl describe pod -n ml "$POD"
expect_re "Warning +ImageUnusable"
expect_text "unusable in this image"
run kubectl get events -n ml --field-selector involvedObject.kind=Deployment
expect_text "ImageUnusable"

say "Nothing of the model was touched: no replica has a node, and the download never ran:"
run kubectl get pods -n ml -l app=sglang -o \
  "jsonpath={range .items[*]}{.metadata.name}{'  node='}{.spec.nodeName}{'\n'}{end}"
expect_no_text "node=node"
[[ ! -e "$MODELS/started" ]] || fail "the model download ran"
say "And the node's registry served not one byte of the model image (its access log, counted):"
run env PYTHONPATH="$REPO" "$PY" -m devcluster --run-dir "$RUN_DIR" model
expect_text "MODEL_SERVED=0"

# --- 5. the loop: the learned verdict refuses the next pod -------------------------------
say "The controller recorded what the preflight found, cluster-wide:"
wait_for "the controller's ImageVerdict" 60 \
  bash -c "kubectl get imageverdicts -o name | grep -q imageverdict"
run kubectl get imageverdicts
expect_text "Unusable"
expect_text "$PROBED_IMAGE"
say "Keyed by the digest containerd reports for the image the preflight ran in:"
run kubectl get -n ml "$PREFLIGHT" -o \
  "jsonpath={.status.initContainerStatuses[?(@.name==\"epguard-probe\")].imageID}"
IMAGE_ID="$OUT"
DIGEST="${IMAGE_ID##*@}"
[[ "$DIGEST" == sha256:* ]] || fail "no digest in the preflight's imageID: $IMAGE_ID"
run kubectl get imageverdicts -o "jsonpath={range .items[*]}{.spec.digest}{'\n'}{end}"
expect_text "$DIGEST"

say "The next pod on that image is refused at apply, with what was learned and where:"
# The webhook learns verdicts from a watch; give it a moment (dry runs create nothing).
wait_for "the webhook to learn the verdict" 60 \
  bash -c "! kubectl apply --dry-run=server -f sglang-1.yaml"
run kubectl apply -f sglang-1.yaml
expect_refused
# The webhook names the pod; the backstop policy, which the API server asks first, says
# "in this cluster" (its entries carry no per-verdict times: docs/backstop.md).
expect_re "seen failing in (pod ml/epguard-preflight-[0-9a-f]+ at|this cluster)"
expect_text "[epguard verdict "
run kubectl get pods -n ml
expect_no_text "sglang-1"

# --- 6. what only the GPU node can tell: the in-pod probe ---------------------------------
ENV_IMAGE="$(cd "$REPO" && "$PY" -c 'from devcluster.images import ENV_ONLY_WORKER; print(ENV_ONLY_WORKER.ref)')"
# Never: the pod stays in Init:Error for the transcript (a Deployment's pods would retry
# the probe in Init:CrashLoopBackOff; tests/e2e/test_probe_on_node.py has both).
pod_yaml sglang-0 "$ENV_IMAGE" Never >sglang-0.yaml
say "A worker on another image nobody has judged, whose files are consistent (SGLang 0.5.20," \
  "torch 2.13.0+cu130, mooncake-transfer-engine-cuda13 0.3.13.post1): the preflight proves" \
  "nothing from its files, so the gate comes off, and the probe the webhook injected first" \
  "runs in the worker's own image with its GPUs, before the model download:"
APPLIED=$(date +%s.%N)
run kubectl apply -f sglang-0.yaml
expect_ok
run kubectl get pod sglang-0 -n ml -o \
  "jsonpath={range .spec.initContainers[*]}{.name}{'  '}{.image}{'  '}{.resources.limits}{'\n'}{end}"
expect_text "epguard-copy-probe  localhost/epguard/epguard:dev"
expect_text "epguard-probe  $ENV_IMAGE  {\"memory\":\"4Gi\",\"nvidia.com/gpu\":\"8\"}"
expect_re "model-download +$BUSYBOX_IMAGE"
# The kubelet runs the probe; wait (quietly) for the termination message it writes.
wait_for "the kubelet to record the probe's termination" 960 \
  bash -c "kubectl get pod sglang-0 -n ml -o jsonpath='{.status.initContainerStatuses[?(@.name==\"epguard-probe\")].state.terminated.message}' | grep -q ."
printf '%s# apply -> preflight -> gate off -> termination message in pod status: %.1fs%s\n' \
  "$DIM" "$(echo "$(date +%s.%N) - $APPLIED" | bc)" "$OFF"
wait_for "the controller's Event on the pod" 60 \
  bash -c "kubectl get events -n ml --field-selector involvedObject.name=sglang-0,reason=MooncakeProbeFailedInPod -o name | grep -q ."
run kubectl get pod sglang-0 -n ml
expect_text "Init:Error"
say "The message below was written by the real probe in the real image, under the real kubelet:"
run kubectl describe pod sglang-0 -n ml
expect_re "epguard.io/Preflight +True"
expect_re "Message: +epguard: mooncake elastic EP is unusable in this pod"
expect_re "Exit Code: +1"
expect_re "Warning +MooncakeProbeFailedInPod"
say "The model download never started: its init container is still waiting, and its marker" \
  "on the hostPath does not exist:"
run kubectl get pod sglang-0 -n ml -o \
  "jsonpath={range .status.initContainerStatuses[*]}{.name}{'  '}{.state}{'\n'}{end}"
expect_re 'model-download +\{"waiting":\{"reason":"PodInitializing"\}\}'
[[ ! -e "$MODELS/started" ]] || fail "the model download ran"
say "The model image volume, though, was pulled before any init container ran (the kubelet's" \
  "order); epguard let it happen only once the image's files were judged. The registry's log:"
run env PYTHONPATH="$REPO" "$PY" -m devcluster --run-dir "$RUN_DIR" model
[[ "${OUT##*MODEL_SERVED=}" -ge 1073741824 ]] || fail "the registry did not serve the whole model"
say "A cause of this node (no GPU driver here), not of the image: nothing is learned about it:"
run kubectl get imageverdicts -o "jsonpath={range .items[*]}{.spec.image}{'\n'}{end}"
expect_no_text "$ENV_IMAGE"
