{{- define "dwdp-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "dwdp-operator.labels" -}}
app.kubernetes.io/name: dwdp-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dwdp-operator.selector" -}}
app.kubernetes.io/name: dwdp-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dwdp-operator.serviceAccountName" -}}
{{- default (include "dwdp-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}
