{{/* Name of the release's objects: the release name, or <release>-kvflow. */}}
{{- define "kvflow.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvflow.operatorName" -}}
{{- printf "%s-operator" (include "kvflow.fullname" .) -}}
{{- end -}}

{{- define "kvflow.labels" -}}
app.kubernetes.io/part-of: kvflow
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvflow.operatorSelector" -}}
app.kubernetes.io/name: kvflow-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* <registry>/<name>:<tag>; call with (list $ "operator"). */}}
{{- define "kvflow.image" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- printf "%s/%s:%s" $root.Values.image.registry $name (default $root.Chart.AppVersion $root.Values.image.tag) -}}
{{- end -}}

{{/* The operator's rights in the namespaces it watches (kvflow.operator.kube.NAMESPACED_RULES;
a test compares them): in the ClusterRole when it watches all, else a Role in each. */}}
{{- define "kvflow.namespacedRules" -}}
# list/watch: kopf's watch and the drift sweep; get: re-read before reconciling.
# No patch: the operator keeps no state on pools (no finalizers, no annotations).
- apiGroups: [kvflow.io]
  resources: [inferencepools]
  verbs: [get, list, watch]
- apiGroups: [kvflow.io]
  resources: [inferencepools/status]
  verbs: [patch]
# Gateways and the models they serve: read like pools, status written.
- apiGroups: [kvflow.io]
  resources: [inferencegateways, inferencemodels]
  verbs: [get, list, watch]
- apiGroups: [kvflow.io]
  resources: [inferencegateways/status, inferencemodels/status]
  verbs: [patch]
# Children name their owner with blockOwnerDeletion; where the API server enforces
# OwnerReferencesPermissionEnforcement (OpenShift does), setting it needs update on the
# owner's finalizers. The operator sets no finalizer.
- apiGroups: [kvflow.io]
  resources: [inferencepools/finalizers, inferencegateways/finalizers]
  verbs: [update]
# watch: a deleted Deployment is put back at once; create: server-side apply of a
# missing object is authorized as a create too.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [list, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, create, patch, delete]
# A pool's generated worker token: created once, never read (no get, list or watch: the
# operator cannot read any Secret).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# The planner counts a pool's ready and unschedulable pods and reads their /metrics.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
{{- end -}}
