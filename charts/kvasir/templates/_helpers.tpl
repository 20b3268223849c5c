{{/* The release's name for every object: "kvasir-operator" unless overridden by the release name. */}}
{{- define "kvasir.fullname" -}}
{{- if contains "kvasir" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvasir-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvasir.selectorLabels" -}}
app.kubernetes.io/name: kvasir-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvasir.labels" -}}
{{ include "kvasir.selectorLabels" . }}
app.kubernetes.io/part-of: kvasir
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvasir.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvasir.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvasir.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
