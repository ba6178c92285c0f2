//go:build tools

// Package tools only records the program this wrapper module builds, so that `go mod tidy`
// keeps its dependencies in go.mod and go.sum.
package tools

import _ "github.com/cilium/cilium/daemon"
