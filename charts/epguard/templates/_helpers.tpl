{{/* Chart name, overridable. */}}
{{- define "epguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object-name prefix: "epguard" for a release named like the chart. */}}
{{- define "epguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "epguard.webhookName" -}}{{ include "epguard.fullname" . | trunc 55 | trimSuffix "-" }}-webhook{{- end -}}
{{- define "epguard.controllerName" -}}{{ include "epguard.fullname" . | trunc 52 | trimSuffix "-" }}-controller{{- end -}}
{{/* The mutating configuration the injection feature adds; the controller keeps its caBundle. */}}
{{- define "epguard.mutatingName" -}}{{ include "epguard.fullname" . | trunc 56 | trimSuffix "-" }}-inject{{- end -}}
{{- define "epguard.rulesConfigMap" -}}epguard-rules{{- end -}}
{{- /* The Secret with the keys that sign injected probes (the controller creates it). */ -}}
{{- define "epguard.probeKeySecret" -}}{{ include "epguard.fullname" . | trunc 53 | trimSuffix "-" }}-probe-key{{- end -}}
{{- /* The outage backstop's name: its ValidatingAdmissionPolicy, with -enforce/-warn/-audit
its bindings, and the label value of its parameter shards (webhook/controller/compiler.py). */ -}}
{{- define "epguard.backstopName" -}}{{ include "epguard.fullname" . | trunc 46 | trimSuffix "-" }}-backstop{{- end -}}
{{- /* "true" when the backstop is on: asked for, and the API server serves the v1 API
and the 1.34 CEL list library its expressions use. Against a cluster, helm's
capabilities list every served kind; an offline render (`helm template`) knows only
group/versions (no kind at all, not even apps/v1/Deployment), so there the group/version
and the Kubernetes version decide. */ -}}
{{- define "epguard.backstopOn" -}}
{{- if and .Values.backstop.enabled (eq (include "epguard.vapServed" .) "true") (semverCompare ">=1.34-0" .Capabilities.KubeVersion.Version) -}}true{{- end -}}
{{- end -}}
{{- /* "true" when the API server serves admissionregistration.k8s.io/v1
ValidatingAdmissionPolicy (GA in 1.30); offline, the group/version and the version do. */ -}}
{{- define "epguard.vapServed" -}}
{{- $api := .Capabilities.APIVersions -}}
{{- if or ($api.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") (and ($api.Has "admissionregistration.k8s.io/v1") (not ($api.Has "apps/v1/Deployment")) (semverCompare ">=1.30-0" .Capabilities.KubeVersion.Version)) -}}true{{- end -}}
{{- end -}}
{{- /* The ClusterRole, binding and policy that let scanRecorder.serviceAccounts record. */ -}}
{{- define "epguard.scanRecorderName" -}}{{ include "epguard.fullname" . | trunc 49 | trimSuffix "-" }}-scan-recorder{{- end -}}

{{- define "epguard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "epguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: epguard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component (webhook, controller, helm-test). */}}
{{- define "epguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epguard.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "epguard.componentLabels" -}}
{{ include "epguard.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "epguard.image" -}}
{{- $img := .Values.image -}}
{{- $ref := printf "%s/%s" $img.registry $img.repository | trimPrefix "/" -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $ref $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $ref (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{- define "epguard.webhookServiceAccount" -}}
{{- default (include "epguard.webhookName" .) .Values.webhook.serviceAccount.name -}}
{{- end -}}
{{- define "epguard.controllerServiceAccount" -}}
{{- default (include "epguard.controllerName" .) .Values.controller.serviceAccount.name -}}
{{- end -}}

{{/* A securityContext dict without null entries (null means "let the platform choose"). */}}
{{- define "epguard.compact" -}}
{{- $out := dict -}}
{{- range $k, $v := . -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* Preferred (not required) spreading over nodes, when no affinity is given. */}}
{{- define "epguard.defaultAffinity" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "epguard.selectorLabels" . | nindent 12 }}
{{- end -}}

{{/*
CEL for matchConditions.

The needle matches every spelling of --elastic-ep-backend that argparse accepts in some
SGLang release (its prefixes down to the shortest one a release leaves unambiguous, not
part of a longer option name: no letter, digit, "_" or "-" on either side) and nothing
else: `--elasticsearch-url` does not match. A flag assembled from variables at run time
(`--ela$REST`) cannot be seen here; the injected probe reads it in the pod.
tests/chart derives the same pattern from SGLang's option table (probe/cmdline.py) and
asserts the two agree. Any container or init container whose command, args or literal
env values hold it is sent to epguard, which covers `--elastic-ep-backend mooncake`, the
`=` form, prefixes, `sh -c "..."` scripts and `$(VAR)` references to env values. The
cheap `contains` runs first, so the regular expression only sees candidates.

Each string is tested as written and, if it holds one, with the shell's quote characters
(' " \) removed (the copy costs CEL budget, so only then: docs/cmdline.md),
because a shell joins quoted pieces to the text beside them: `-''-elastic-ep-backend`,
`--el"astic"-ep-backend` and `\--elastic-ep-backend` inside `sh -c` are the flag
(probe/shell.py reads them so, and shell.unquoted is the same removal for the webhook's
and the probe's own cheap test). Removing quotes can only add matches, never lose one
(the string as written is still tested). What CEL cannot undo, like a variable (above)
or a `$'\x2d'` escape, is left to the probe.
*/}}
{{- define "epguard.cel.needle" -}}--el{{- end -}}
{{- define "epguard.cel.needlePattern" -}}
(^|[^A-Za-z0-9_-])--el(a(s(t(i(c(-(e(p(-(b(a(c(k(e(n(d)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?)?([^A-Za-z0-9_-]|$)
{{- end -}}

{{/* CEL: string variable s, as written or with its quotes removed, holds a spelling of the flag. */}}
{{- define "epguard.cel.holds" -}}
([string({{ .s }})] + (string({{ .s }}).matches('[\'"\\\\]') ? [string({{ .s }}).replace("'", '').replace('"', '').replace('\\', '')] : [])).exists(q, q.contains('{{ include "epguard.cel.needle" . }}') && q.matches('{{ include "epguard.cel.needlePattern" . }}'))
{{- end -}}

{{/* CEL: container variable c mentions the flag. */}}
{{- define "epguard.cel.container" -}}
(has({{ .c }}.command) && {{ .c }}.command.exists(s, {{ include "epguard.cel.holds" (dict "s" "s") }})) || (has({{ .c }}.args) && {{ .c }}.args.exists(s, {{ include "epguard.cel.holds" (dict "s" "s") }})) || (has({{ .c }}.env) && {{ .c }}.env.exists(e, has(e.value) && {{ include "epguard.cel.holds" (dict "s" "e.value") }}))
{{- end -}}

{{/*
CEL: the pod spec at dotted path .path mentions the needle. Every step of the path is
guarded by has(), so an object of another shape (or with fields missing) evaluates to
false instead of an error -- an error would apply failurePolicy to an unrelated object.
*/}}
{{- define "epguard.cel.podSpec" -}}
{{- $parts := splitList "." .path -}}
{{- $guards := list -}}
{{- $acc := first $parts -}}
{{- range rest $parts -}}
{{- $acc = printf "%s.%s" $acc . -}}
{{- $guards = append $guards (printf "has(%s)" $acc) -}}
{{- end -}}
{{- $lists := list -}}
{{- range list "containers" "initContainers" -}}
{{- $lists = append $lists (printf "(has(%s.%s) && %s.%s.exists(c, %s))" $acc . $acc . (include "epguard.cel.container" (dict "c" "c"))) -}}
{{- end -}}
({{ if $guards }}{{ join " && " $guards }} && {{ end }}({{ join " || " $lists }}))
{{- end -}}

{{/*
CEL: some value reached by a template path (webhook/engine/workloads.py TemplatePath: dotted
fields, `name[]` for every item of a list, `*` for every value of a map) mentions the
needle. .var is the CEL expression walked so far, .segs the segments left, .shape what
the path ends on (template, podSpec or container), .depth names the loop variables.
Every step is guarded by has(), as above.
*/}}
{{- define "epguard.cel.walk" -}}
{{- if not .segs -}}
{{- if eq .shape "template" -}}
{{ include "epguard.cel.podSpec" (dict "path" (printf "%s.spec" .var)) }}
{{- else if eq .shape "podSpec" -}}
{{ include "epguard.cel.podSpec" (dict "path" .var) }}
{{- else -}}
({{ include "epguard.cel.container" (dict "c" .var) }})
{{- end -}}
{{- else -}}
{{- $seg := first .segs -}}
{{- $next := dict "segs" (rest .segs) "shape" .shape "depth" (add1 .depth) -}}
{{- $v := printf "x%d" .depth -}}
{{- if eq $seg "*" -}}
{{ .var }}.map(k{{ .depth }}, {{ .var }}[k{{ .depth }}]).exists({{ $v }}, {{ include "epguard.cel.walk" (set $next "var" $v) }})
{{- else if hasSuffix "[]" $seg -}}
{{- $f := trimSuffix "[]" $seg -}}
(has({{ .var }}.{{ $f }}) && {{ .var }}.{{ $f }}.exists({{ $v }}, {{ include "epguard.cel.walk" (set $next "var" $v) }}))
{{- else -}}
(has({{ .var }}.{{ $seg }}) && {{ include "epguard.cel.walk" (set $next "var" (printf "%s.%s" .var $seg)) }})
{{- end -}}
{{- end -}}
{{- end -}}

{{/* CEL: an object of a kind described by template paths (.kind: templates, podSpecs,
containers lists) mentions the needle in any of them. */}}
{{- define "epguard.cel.kind" -}}
{{- $any := list -}}
{{- range $shape := list "template" "podSpec" "container" -}}
{{- range (get $.kind (printf "%ss" $shape) | default list) -}}
{{- $any = append $any (include "epguard.cel.walk" (dict "var" "object" "segs" (splitList "." .) "shape" $shape "depth" 0)) -}}
{{- end -}}
{{- end -}}
{{ join " || " $any }}
{{- end -}}

{{/* CEL: a Pod (object.spec) mentions the needle. The pods webhook of the validating
configuration and both webhooks of the mutating one use exactly this text. */}}
{{- define "epguard.cel.pod" -}}
{{ include "epguard.cel.podSpec" (dict "path" "object.spec") }}
{{- end -}}

{{/* The values of epguard.io/inject that opt in, on a namespace label or a pod annotation
(webhook/engine/namespaces.py INJECT_ON; tests/chart asserts they agree). */}}
{{- define "epguard.injectValues" -}}["enabled", "true"]{{- end -}}

{{/* CEL: the Pod carries the opt-in annotation epguard.io/inject (see injectValues).
Guarded, so a pod without annotations is false, never an error. */}}
{{- define "epguard.cel.injectAnnotation" -}}
has(object.metadata) && has(object.metadata.annotations) && 'epguard.io/inject' in object.metadata.annotations && object.metadata.annotations['epguard.io/inject'] in {{ include "epguard.injectValues" . }}
{{- end -}}

{{/* Namespaces no webhook of epguard is ever called for: kube-system, the release namespace,
webhook.excludeNamespaces, and any namespace labelled epguard.io/ignore=true. A list of
LabelSelectorRequirements (matchExpressions). */}}
{{- define "epguard.namespaceExclusions" -}}
{{- $excluded := concat (list "kube-system" .Release.Namespace) .Values.webhook.excludeNamespaces | uniq -}}
- key: kubernetes.io/metadata.name
  operator: NotIn
  values: {{ toJson $excluded }}
- key: epguard.io/ignore
  operator: NotIn
  values: ["true"]
{{- end -}}

{{/* Annotations of both webhook configurations: webhook.annotations, plus cainjector's
when cert-manager provides the TLS. */}}
{{- define "epguard.webhookConfigAnnotations" -}}
{{- $annotations := deepCopy .Values.webhook.annotations -}}
{{- if .Values.tls.certManager.enabled -}}
{{- $_ := set $annotations "cert-manager.io/inject-ca-from" (printf "%s/%s" .Release.Namespace (include "epguard.webhookName" .)) -}}
{{- end -}}
{{- with $annotations -}}
{{ toYaml . }}
{{- end -}}
{{- end -}}

{{/* The probe-copy image of injection: injection.image, else the chart's own image. */}}
{{- define "epguard.injectImage" -}}
{{- default (include "epguard.image" .) .Values.injection.image -}}
{{- end -}}

{{/* A container's env: .env (the chart's own, YAML text) followed by .extra (a values list).
An extra variable that the chart already sets fails the render: a duplicate name would
shadow or be shadowed depending on the tool (the kubelet takes the last, server-side
apply refuses the duplicate key), so the value's own setting is the one place for it. */}}
{{- define "epguard.envWithExtra" -}}
{{- $env := fromYamlArray .env -}}
{{- $names := list -}}
{{- range $env -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- range .extra -}}
{{- if has .name $names -}}
{{- fail (printf "%s sets %s, which the chart already sets from its values: set the value instead (see values.yaml)" $.what .name) -}}
{{- end -}}
{{- end -}}
{{- toYaml (concat $env .extra) -}}
{{- end -}}
