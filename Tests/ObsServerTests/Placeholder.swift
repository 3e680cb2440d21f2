// Placeholder while the in-process tests move to the new event loop (temporary).
import Testing
@Suite struct Placeholder { @Test func nothing() {} }
