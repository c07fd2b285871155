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
