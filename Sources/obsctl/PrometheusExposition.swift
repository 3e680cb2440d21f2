// obsctl — a small writer of the Prometheus text exposition format, version 0.0.4: the
// format node_exporter's textfile collector reads and every Prometheus server scrapes.
// Used by `obsctl stats --prometheus` to format another process's counters (obsd's), which
// is why it is a plain value built per run rather than a metrics backend. swift-prometheus
// is one, for a process's own metrics; the README (Metrics) says what this writer handles
// that its registry does not — name clashes reported rather than fatal, a fixed order.

/// Metric families in the Prometheus text exposition format, version 0.0.4.
///
/// The rules it keeps (from the format's specification):
/// - a metric name matches `[a-zA-Z_:][a-zA-Z0-9_:]*`; a label name matches
///   `[a-zA-Z_][a-zA-Z0-9_]*` and does not start with `__` (reserved); names are checked
///   when a family is added, so what is rendered is always well-formed;
/// - each family is written once, as `# HELP`, `# TYPE`, then all of its samples together;
/// - in `# HELP` text a backslash is written `\\` and a line feed `\n`; in a label value a
///   backslash, a double quote and a line feed are written `\\`, `\"` and `\n`; nothing
///   else is escaped (text is UTF-8);
/// - sample values are floats as Go parses them: integers as plain digits, `NaN`, `+Inf`,
///   `-Inf`;
/// - every line ends with a line feed, the last one included.
///
/// Families are rendered in the order they were added.
struct PrometheusExposition: Sendable {
    /// The type a `# TYPE` line declares.
    enum MetricType: String, Sendable {
        /// Only goes up (and resets to zero when the process restarts); named `…_total`.
        case counter
        /// Goes up and down.
        case gauge
        /// A value of unknown kind.
        case untyped
    }

    /// One sample: its labels, in order, and its value.
    struct Sample: Sendable {
        var labels: [(name: String, value: String)]
        var value: Double

        init(labels: [(name: String, value: String)] = [], _ value: Double) {
            self.labels = labels
            self.value = value
        }
    }

    /// One metric family: a name, its help text and type, and its samples.
    struct Family: Sendable {
        let name: String
        let help: String
        let type: MetricType
        let samples: [Sample]
    }

    /// Why a family could not be added.
    enum Problem: Error, Equatable, CustomStringConvertible {
        /// The metric name does not match `[a-zA-Z_:][a-zA-Z0-9_:]*`.
        case invalidMetricName(String)
        /// A label name does not match `[a-zA-Z_][a-zA-Z0-9_]*`, or starts with `__`.
        case invalidLabelName(metric: String, label: String)
        /// A sample names the same label twice.
        case repeatedLabel(metric: String, label: String)
        /// A family of that name, or one a parser would confuse it with (`x` and the counter
        /// `x_total`), was already added.
        case duplicateFamily(String)

        var description: String {
            switch self {
            case .invalidMetricName(let name): return "\(name) is not a valid metric name"
            case .invalidLabelName(let metric, let label): return "\(metric): \(label) is not a valid label name"
            case .repeatedLabel(let metric, let label): return "\(metric): label \(label) given twice in one sample"
            case .duplicateFamily(let name): return "a metric family named \(name) (or one that reads the same) already exists"
            }
        }
    }

    /// The families added so far, in order.
    private(set) var families: [Family] = []
    /// Every name a parser may take as a family's: the name, and a counter's name without `_total`.
    private var takenNames: Set<String> = []

    init() {}

    /// Whether `name` is already taken by a family (see `Problem.duplicateFamily`).
    func isTaken(_ name: String) -> Bool {
        Self.familyNames(name).contains { takenNames.contains($0) }
    }

    /// Adds a family. Throws, adding nothing, if a name is invalid or already taken.
    mutating func add(_ name: String, _ type: MetricType, help: String, samples: [Sample]) throws(Problem) {
        guard Self.isValidMetricName(name) else { throw .invalidMetricName(name) }
        for sample in samples {
            var seen: Set<String> = []
            for label in sample.labels {
                guard Self.isValidLabelName(label.name) else { throw .invalidLabelName(metric: name, label: label.name) }
                guard seen.insert(label.name).inserted else { throw .repeatedLabel(metric: name, label: label.name) }
            }
        }
        guard !isTaken(name) else { throw .duplicateFamily(name) }
        takenNames.formUnion(Self.familyNames(name))
        families.append(Family(name: name, help: help, type: type, samples: samples))
    }

    /// Adds a family with one sample and no labels.
    mutating func add(_ name: String, _ type: MetricType, help: String, value: Double) throws(Problem) {
        try add(name, type, help: help, samples: [Sample(value)])
    }

    /// The exposition: every family's lines, each ending with a line feed.
    var text: String {
        var out = ""
        for family in families {
            out += "# HELP \(family.name) \(Self.escapeHelp(family.help))\n"
            out += "# TYPE \(family.name) \(family.type.rawValue)\n"
            for sample in family.samples {
                out += family.name
                if !sample.labels.isEmpty {
                    out += "{"
                    out += sample.labels.map { "\($0.name)=\"\(Self.escapeLabelValue($0.value))\"" }.joined(separator: ",")
                    out += "}"
                }
                out += " \(Self.format(sample.value))\n"
            }
        }
        return out
    }

    // MARK: - The format's rules

    /// A label value as written between double quotes: `\` → `\\`, `"` → `\"`, line feed → `\n`.
    static func escapeLabelValue(_ value: String) -> String {
        var out = ""
        out.reserveCapacity(value.utf8.count)
        for scalar in value.unicodeScalars {
            switch scalar {
            case "\\": out += "\\\\"
            case "\"": out += "\\\""
            case "\n": out += "\\n"
            default: out.unicodeScalars.append(scalar)
            }
        }
        return out
    }

    /// Help text as written after `# HELP name `: `\` → `\\`, line feed → `\n`.
    static func escapeHelp(_ text: String) -> String {
        var out = ""
        out.reserveCapacity(text.utf8.count)
        for scalar in text.unicodeScalars {
            switch scalar {
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            default: out.unicodeScalars.append(scalar)
            }
        }
        return out
    }

    /// A sample value: integral values as digits (`3`, not `3.0`), `NaN`, `+Inf`, `-Inf`,
    /// anything else in Swift's shortest round-trip form (`0.25`, `1e+20`), which Go's
    /// `ParseFloat` reads.
    static func format(_ value: Double) -> String {
        if value.isNaN { return "NaN" }
        if value == .infinity { return "+Inf" }
        if value == -.infinity { return "-Inf" }
        if value == value.rounded(.towardZero), abs(value) < 1e15 { return String(Int64(value)) }
        return "\(value)"
    }

    /// Whether `name` matches `[a-zA-Z_:][a-zA-Z0-9_:]*`.
    static func isValidMetricName(_ name: String) -> Bool {
        guard let first = name.utf8.first, isLetter(first) || first == UInt8(ascii: "_") || first == UInt8(ascii: ":") else {
            return false
        }
        return name.utf8.allSatisfy { isLetter($0) || isDigit($0) || $0 == UInt8(ascii: "_") || $0 == UInt8(ascii: ":") }
    }

    /// Whether `name` matches `[a-zA-Z_][a-zA-Z0-9_]*` and does not start with `__`.
    static func isValidLabelName(_ name: String) -> Bool {
        guard let first = name.utf8.first, isLetter(first) || first == UInt8(ascii: "_"), !name.hasPrefix("__") else {
            return false
        }
        return name.utf8.allSatisfy { isLetter($0) || isDigit($0) || $0 == UInt8(ascii: "_") }
    }

    private static func isLetter(_ b: UInt8) -> Bool {
        (UInt8(ascii: "a")...UInt8(ascii: "z")).contains(b) || (UInt8(ascii: "A")...UInt8(ascii: "Z")).contains(b)
    }

    private static func isDigit(_ b: UInt8) -> Bool { (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(b) }

    /// The names a parser may file a family under: its own, and for `x_total`, `x` (a counter's
    /// family name in OpenMetrics and in the Python client's parser).
    private static func familyNames(_ name: String) -> [String] {
        name.hasSuffix("_total") ? [name, String(name.dropLast("_total".count))] : [name]
    }
}
