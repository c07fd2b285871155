#!/usr/bin/env bash
# kvflow end to end on a kind cluster: build the three images, load them into kind, install
# the chart, create a pool of CPU workers on the default model, and send OpenAI requests
# through the gateway's Service. Needs docker, kind, kubectl, helm, curl. See e2e/README.md.
#
#   e2e/kind.sh                  # creates (or reuses) the kind cluster "kvflow-e2e"
#   KEEP_CLUSTER=0 e2e/kind.sh   # delete the cluster afterwards
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="${KIND_CLUSTER:-kvflow-e2e}"
TAG="${KVFLOW_TAG:-dev}"
NAMESPACE=demo
POOL=smollm2
LOCAL_PORT="${LOCAL_PORT:-18000}"
READY_TIMEOUT="${READY_TIMEOUT:-15m}"   # first pull of the worker image is the slow part

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
for tool in docker kind kubectl helm curl; do
  command -v "$tool" >/dev/null || { echo "e2e/kind.sh needs $tool on PATH" >&2; exit 2; }
done

step "kind cluster $CLUSTER"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
kubectl config use-context "kind-$CLUSTER" >/dev/null

step "images kvflow/{operator,router,worker}:$TAG"
for image in operator router worker; do
  docker build -f "docker/$image.Dockerfile" -t "kvflow/$image:$TAG" .
  kind load docker-image --name "$CLUSTER" "kvflow/$image:$TAG"
done

step "helm install (CRD, operator, Redis)"
helm upgrade --install kvflow helm/kvflow \
  --namespace kvflow-system --create-namespace \
  --set image.registry=kvflow --set image.tag="$TAG" --set image.pullPolicy=IfNotPresent \
  --set redis.enabled=true \
  --wait --timeout 5m

step "InferencePool $NAMESPACE/$POOL (samples/cpu-smollm2.yaml)"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -n "$NAMESPACE" -f samples/cpu-smollm2.yaml
kubectl patch kvpool "$POOL" -n "$NAMESPACE" --type merge -p \
  "{\"spec\":{\"router\":{\"redis\":{\"url\":\"redis://kvflow-redis.kvflow-system.svc:6379/0\"}}}}"
if ! kubectl wait -n "$NAMESPACE" kvpool/"$POOL" --for=jsonpath='{.status.phase}'=Ready \
    --timeout="$READY_TIMEOUT"; then
  kubectl get kvpool,deploy,pods -n "$NAMESPACE" -o wide
  kubectl describe kvpool "$POOL" -n "$NAMESPACE"
  exit 1
fi
kubectl get kvpool -n "$NAMESPACE" -o wide

step "requests through svc/$POOL-gateway"
kubectl port-forward -n "$NAMESPACE" "svc/$POOL-gateway" "$LOCAL_PORT:80" >/dev/null &
forward=$!
trap 'kill $forward 2>/dev/null || true' EXIT
for _ in $(seq 30); do curl -fs "localhost:$LOCAL_PORT/health" >/dev/null && break; sleep 1; done
base="http://localhost:$LOCAL_PORT/v1"
model=smollm2-135m-instruct
auth="authorization: Bearer demo-key-change-me"   # the sample's tenant (its tenants Secret)

echo "--- GET /v1/models"
curl -fsS "$base/models" -H "$auth"; echo
for prompt in "What is the capital of France?" "Name three primary colors." \
              "What is the capital of France? Answer in one word."; do
  echo "--- chat: $prompt"
  curl -fsS "$base/chat/completions" -H "$auth" -H 'content-type: application/json' -d "{
    \"model\": \"$model\", \"max_tokens\": 48, \"temperature\": 0,
    \"messages\": [{\"role\": \"user\", \"content\": \"$prompt\"}]}"
  echo
done
echo "--- streaming completion"
curl -fsSN "$base/completions" -H "$auth" -H 'content-type: application/json' -d "{
  \"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16,
  \"stream\": true}"
echo

step "what the operator did"
kubectl get events -n "$NAMESPACE" --field-selector involvedObject.kind=InferencePool
kubectl get deploy,svc,pdb,pods -n "$NAMESPACE" -l "kvflow.io/pool=$POOL" -o wide

if [[ "${KEEP_CLUSTER:-1}" == 0 ]]; then
  step "deleting kind cluster $CLUSTER"
  kind delete cluster --name "$CLUSTER"
fi
