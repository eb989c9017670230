{{- define "myresource-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "myresource-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "myresource-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "myresource-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The selector labels as a label selector, for the replicas to find each other. */}}
{{- define "myresource-operator.selector" -}}
app.kubernetes.io/name={{ include "myresource-operator.name" . }},app.kubernetes.io/instance={{ .Release.Name }}
{{- end -}}

{{- define "myresource-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "myresource-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "myresource-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "myresource-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}
