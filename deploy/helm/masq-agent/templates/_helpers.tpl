{{/* The image, with the chart's appVersion where no tag is given. */}}
{{- define "masq-agent.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The port of an ADDR:PORT value. */}}
{{- define "masq-agent.port" -}}
{{ regexFind "[0-9]+$" . }}
{{- end }}

{{/* The host of an ADDR:PORT value, without an IPv6 address's brackets. */}}
{{- define "masq-agent.host" -}}
{{ regexReplaceAll ":[0-9]+$" . "" | trimPrefix "[" | trimSuffix "]" }}
{{- end }}

{{/* The path the agent reads its config at: the file, or with more ConfigMaps, the directory. */}}
{{- define "masq-agent.configPath" -}}
{{- if .Values.config.extraConfigMaps -}}
/etc/config
{{- else -}}
/etc/config/ip-masq-agent
{{- end -}}
{{- end }}

{{/* The config file the chart writes with config.create: the keys that are set, in order. */}}
{{- define "masq-agent.configFile" -}}
{{- $config := .Values.config -}}
{{- range $key := list "nonMasqueradeCIDRs" "masqueradeCIDRs" "nonMasqueradeSrcCIDRs" "masqueradeSrcCIDRs" "masqueradeAddress" "masqueradeAddressIPv6" "masqLinkLocal" "masqLinkLocalIPv6" "enableIPv6" "resyncInterval" "cidrLimit" }}
{{- $value := index $config $key -}}
{{- if not (kindIs "invalid" $value) }}
{{ dict $key $value | toYaml }}
{{- end }}
{{- end }}
{{- end }}
